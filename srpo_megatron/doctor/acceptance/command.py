"""Run the acceptance checks in order and print them: one JSON line per check, then a summary line.

    srpo doctor --acceptance [RECIPE] [--json]

Exit status 0 when every check is ok, warn or skipped; 1 when one failed (the summary names them).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from srpo_megatron.doctor.acceptance import (
    output_layer,
    release_resume,
    sglang_live,
    sglang_live_fp8,
    te_attention,
    train_run,
    versions,
)
from srpo_megatron.doctor.acceptance.registry import (
    AcceptanceCheck,
    Context,
    Probes,
    Result,
    exit_code,
    run_check,
    summary_line,
)

BUDGET_S = 600.0  # the whole run: what a user of a fresh node is promised
CHECK_CAP_S = 300.0  # one check's subprocesses (a server start, a train run) at most

# The registry, in run order: cheap facts first, so a broken part is named before the runs that need it.
REGISTRY: tuple[AcceptanceCheck, ...] = (
    *versions.CHECKS,
    *te_attention.CHECKS,
    *output_layer.CHECKS,
    *sglang_live.CHECKS,
    *sglang_live_fp8.CHECKS,
    *release_resume.CHECKS,
    *train_run.CHECKS,
)


def _not_run(check: AcceptanceCheck, budget_s: float) -> Result:
    fix = "run again; report which checks ran long (their seconds) if it repeats"
    return Result(
        check.name, "fail", f"not run: the {budget_s:.0f} s budget is spent", check.proves, fix, 0.0, {}
    )


def run_acceptance(
    recipe: str | None,
    probes: Probes | None = None,
    work_dir: Path | None = None,
    emit=None,
    overrides: tuple[str, ...] = (),
    budget_s: float = BUDGET_S,
) -> list[Result]:
    """Every check of :data:`REGISTRY`; ``emit(result)`` is called as each one ends (a live report). A
    check that would start with under 10 s of ``budget_s`` left fails as not run."""
    work = Path(work_dir) if work_dir else Path(tempfile.mkdtemp(prefix="srpo-acceptance-"))
    ctx = Context(probes or Probes(), recipe or "", work, overrides=tuple(overrides))
    results, deadline = [], time.monotonic() + budget_s
    for check in REGISTRY:
        ctx.timeout_s = min(CHECK_CAP_S, deadline - time.monotonic())
        result = _not_run(check, budget_s) if ctx.timeout_s < 10 else run_check(check, ctx)
        results.append(result)
        if emit is not None:
            emit(result)
    return results


def _text(r: Result) -> str:
    word = r.status if r.status in ("ok", "skipped") else r.status.upper()
    line = f"  {word:<7}  {r.check}  {r.detail}"
    return line + (f"  -> {r.fix}" if r.status in ("fail", "warn") else "")


def acceptance_main(
    recipe: str | None, as_json: bool, probes: Probes | None = None, overrides: tuple[str, ...] = ()
) -> int:
    if recipe:  # a recipe the train check cannot load: one line now (srpo's exit status 2), not a log later
        from srpo_megatron.config import load_recipe

        load_recipe(recipe, list(overrides))
    start = time.monotonic()

    def emit(r: Result) -> None:
        print(r.json_line() if as_json else _text(r), flush=True)

    if not as_json:
        print("srpo doctor --acceptance: does this node's GPU stack work? (one line per check)", flush=True)
    results = run_acceptance(recipe, probes, emit=emit, overrides=overrides)
    line = summary_line(results, time.monotonic() - start)
    if as_json:
        print(line, flush=True)
    else:
        failed_names = [r.check for r in results if r.status == "fail"]
        verdict = f"FAILED: {', '.join(failed_names)}" if failed_names else "passed"
        print(f"srpo doctor --acceptance: {verdict}", flush=True)
    return exit_code(results)


if __name__ == "__main__":
    sys.exit(acceptance_main(sys.argv[1] if len(sys.argv) > 1 else None, True))
