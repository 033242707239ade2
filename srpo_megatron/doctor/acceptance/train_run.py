"""A 3-step ``srpo train`` with the SGLang engine and Transformer Engine's layer spec, on this node.

Without a RECIPE: the tiny recipe (``examples/tiny_cpu_test.yaml``) on a tiny random Qwen3 with the real
tokenizer, written by ``tools/gpu_smoke_checks.py prepare-tiny`` (the source tree the image installs
from). With a RECIPE: that recipe and the doctor's ``--override`` items, its paths as they are. Either
way: ``train.steps=3``, the run directory under the doctor's scratch folder, ``rollout.engine=sglang``,
``performance.layer_spec=te``, bf16. Passing means three finite steps, no engine restart, and the
trainer-vs-engine log-prob gap (``logprob/gap_mean``, the parity metric) reported.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

from srpo_megatron.doctor.acceptance.registry import (
    AcceptanceCheck,
    Context,
    Outcome,
    failed,
    needs_cuda,
    passed,
)

REPO = Path(__file__).resolve().parents[3]
TINY_RECIPE = REPO / "examples" / "tiny_cpu_test.yaml"
STEPS = 3


def train_command(ctx: Context, run_dir: Path, tiny: Path | None) -> list[str]:
    recipe = str(TINY_RECIPE) if tiny is not None else ctx.recipe
    overrides = [f"train.steps={STEPS}", f"run.dir={run_dir}", "run.save_every=0", "run.tensorboard=false"]
    overrides += ["rollout.engine=sglang", "performance.layer_spec=te", "model.params_dtype=bf16"]
    if tiny is not None:
        hf = tiny / "qwen3"
        overrides += [f"model.hf_dir={hf}", f"data.train_files=[{tiny / 'train.jsonl'}]"]
        overrides += [f"rollout.sglang={{model_path: {hf}, engine_kwargs: {{mem_fraction_static: 0.3}}}}"]
    cmd = [sys.executable, "-m", "srpo_megatron.cli", "train", recipe]
    for o in [*ctx.overrides, *overrides]:  # the doctor's own come last: they win
        cmd += ["-o", o]
    return cmd


def judge_metrics(rows: list[dict]) -> Outcome:
    """Three finite steps, no engine restart, the parity metric present."""
    if len(rows) < STEPS:
        return failed(f"metrics.jsonl has {len(rows)} step(s), not {STEPS}")
    losses = [r.get("loss/total") for r in rows]
    if not all(v is not None and math.isfinite(float(v)) for v in losses):
        return failed(f"non-finite or missing loss/total: {losses}")
    restarts = [r.get("engine/restarts", 0) for r in rows]
    if any(restarts):
        return failed(f"engine/restarts {restarts}: an engine was restarted in a run nothing faulted")
    gaps = [r.get("logprob/gap_mean") for r in rows]
    if any(g is None or not math.isfinite(float(g)) for g in gaps):
        return failed(f"the parity metric logprob/gap_mean is missing or not finite: {gaps}")
    return passed(
        f"{len(rows)} steps, loss/total {[round(float(v), 4) for v in losses]}, trainer-vs-engine "
        f"log-prob gap {[round(float(g), 4) for g in gaps]}",
        logprob_gap_mean=[float(g) for g in gaps],
    )


def check_train(ctx: Context) -> Outcome:
    if not ctx.probes.cuda_available():
        return needs_cuda("the SGLang engine and TE's layer spec run on a GPU (a CPU run has neither)")
    work = Path(ctx.work_dir)
    tiny = None
    if not ctx.recipe:
        tiny = work / "tiny"
        prep = [sys.executable, str(REPO / "tools" / "gpu_smoke_checks.py"), "prepare-tiny", str(tiny)]
        done = subprocess.run(prep, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            return failed(f"prepare-tiny failed: {done.stderr.strip().splitlines()[-1:]}")
    run_dir = work / "train_run"
    log = work / "train.log"
    with log.open("w") as f:
        try:
            rc = subprocess.run(
                train_command(ctx, run_dir, tiny), stdout=f, stderr=subprocess.STDOUT, timeout=ctx.timeout_s
            ).returncode
        except subprocess.TimeoutExpired:
            return failed(f"srpo train did not finish {STEPS} steps in {ctx.timeout_s:.0f} s (log: {log})")
    if rc != 0:
        tail = log.read_text().strip().splitlines()[-2:]
        return failed(f"srpo train exited {rc}: {' | '.join(tail)} (log: {log})")
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()] if metrics.is_file() else []
    return judge_metrics(rows)


CHECKS = (
    AcceptanceCheck(
        "train_3_steps",
        f"`srpo train` runs {STEPS} SRPO steps with the SGLang engine and TE's spec; parity metric reported",
        "read the train log the detail names; the checks above name the part that is broken",
        check_train,
    ),
)
