"""The training-metric regression gate: a short deterministic CPU SRPO run compared, step by step, with the
history kept in the repository (``tools/dev gate``; issue 28).

The gated run is ``examples/tiny_cpu_test.yaml`` with ``RUN_OVERRIDES``: a 2-layer random Qwen3 with the real
Qwen vocabulary and a sharpened output head (``write_tiny_qwen3(head_std=...)``: teacher entropies well below
the uniform limit, so w̃, the SDPO divergence and the SDPO loss carry signal), ``coin_reward`` (a hash of
the response text: mixed groups, and all-wrong groups, from step 1), held-out avg@k and greedy accuracy
before the first and after the last step. One process, ``OMP_NUM_THREADS=1``: bit-identical on reruns.

- ``tests/gate/tolerances.json``: the GATED metrics (its keys) and each one's band, abs + rel·|history|.
  Only these are compared: metrics added later are ignored until a key is added here.
- ``tests/gate/history.json``: per gated metric, ``{step: value}`` of the last accepted run (held-out
  accuracy under ``eval/avg@k`` and ``eval/greedy`` at steps 0 and the last). ``--update`` rewrites it;
  review its diff like code.

``python -m srpo_megatron.testing.gate [-o KEY=VALUE ...] [--plant NAME] [--update] [--out DIR]``: exit 0 when
every gated value lies in its band; else a table (metric, step, value, band, distance in band widths) and one
PNG per moved metric (its history, band and this run) under ``--out``.

Measured (2026-12-02, this machine kind, load ~10): the gated run takes 70-120 s (6 steps, 24 samples each,
2 held-out evaluations); a rerun is bit-identical (all 94 gated values at 0 band widths). A run with 2
threads (another reduction order, the stand-in for another CPU's rounding) kept every rollout and training
reward, drifted float metrics by at most 6.3e-4 relative (loss/sdpo, step 4) and flipped one of the 32
held-out avg@2 samples: hence rel 5e-3 on float metrics, exact counts on training rewards and routing, one
sample on held-out accuracy (``tests/gate/tolerances.json``, each with its reason). Largest move of each
planted regression (``gate_plants``), in band half-widths: entropy weights off 3e8 (w̃ mean 2.9e4), TIS cap
0.5 100 (grad norm; the losses halve), EMA α 0.2 2.5e8 (from step 2; float metrics 415), all-wrong groups to
SDPO 4e8 (route/sdpo_frac from step 1).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "examples" / "tiny_cpu_test.yaml"
GATE_DIR = REPO / "tests" / "gate"
HISTORY = GATE_DIR / "history.json"
TOLERANCES = GATE_DIR / "tolerances.json"
HEAD_STD = 0.5  # output-head std of the gated model (logit std ~4: peaked next-token distributions)
NUM_TRAIN, NUM_HELDOUT = 64, 16
# The gated run on top of the tiny recipe (paths are added by ``run_overrides``).
RUN_OVERRIDES = [
    "run.seed=7",
    "run.save_every=0",
    "run.tensorboard=false",
    "rollout.prompts_per_step=6",
    "rollout.group_size=4",
    "rollout.max_new_tokens=8",
    "train.steps=6",
    "train.micro_batch_size=8",
    "train.eval_at_ends=true",
    "train.eval_greedy=true",
    "eval.k=2",
    "eval.max_new_tokens=8",
]


@dataclass(frozen=True)
class Moved:
    """One gated value outside its band (``value`` None: the run did not log it)."""

    metric: str
    step: int
    value: float | None
    expected: float
    half_width: float

    @property
    def band(self) -> tuple[float, float]:
        return self.expected - self.half_width, self.expected + self.half_width

    @property
    def widths(self) -> float:
        """Distance from the history value in band half-widths (> 1: outside the band)."""
        if self.value is None or not math.isfinite(self.value):
            return math.inf
        return abs(self.value - self.expected) / self.half_width if self.half_width > 0 else math.inf


def write_inputs(root: Path) -> tuple[Path, Path, Path]:
    """The gated run's model folder, train prompts and held-out prompts under ``root`` (reused if present)."""
    from srpo_megatron.testing.tiny import write_tiny_qwen3

    hf = write_tiny_qwen3(root / f"qwen3_head{HEAD_STD}", head_std=HEAD_STD)
    train, heldout = root / "train.jsonl", root / "heldout.jsonl"
    rows = [f"Tell me a fact about the number {i}." for i in range(NUM_TRAIN)]
    held = [f"Name a colour that rhymes with {i}." for i in range(NUM_HELDOUT)]
    for path, prompts in ((train, rows), (heldout, held)):
        path.write_text(
            "".join(
                json.dumps({"prompt": p, "system": None, "answer": "-", "kind": "coin"}) + "\n"
                for p in prompts
            )
        )
    return hf, train, heldout


def run_overrides(inputs: tuple[Path, Path, Path], run_dir: Path, extra: list[str]) -> list[str]:
    hf, train, heldout = inputs
    return [
        f"model.hf_dir={hf}",
        f"data.train_files=[{train}]",
        f"data.eval_files=[{heldout}]",
        f"run.dir={run_dir}",
        *RUN_OVERRIDES,
        *extra,
    ]


def run_gated(work: Path, extra: list[str], plant: str | None = None) -> dict[str, dict[int, float]]:
    """Run the gated training in a fresh process under ``work``; return ``{metric: {step: value}}`` for every
    numeric metric it logged (train metrics per step; held-out accuracy as ``eval/*`` at the eval steps)."""
    from srpo_megatron.testing.gate_plants import CODE_PLANTS, OVERRIDE_PLANTS

    if plant is not None and plant not in OVERRIDE_PLANTS and plant not in CODE_PLANTS:
        raise SystemExit(
            f"gate: unknown plant {plant!r}; choose one of {', '.join(OVERRIDE_PLANTS)}, "
            f"{', '.join(CODE_PLANTS)}"
        )
    if plant in OVERRIDE_PLANTS:
        extra = [*extra, *OVERRIDE_PLANTS[plant]]
    work.mkdir(parents=True, exist_ok=True)
    run_dir = work / "run"
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    args = ["train", str(RECIPE)]
    for o in run_overrides(write_inputs(work / "inputs"), run_dir, extra):
        args += ["--override", o]
    entry = (
        ["-m", "srpo_megatron.testing.gate_plants", plant]
        if plant in CODE_PLANTS
        else ["-m", "srpo_megatron.cli"]
    )
    env = {
        **os.environ,
        # one thread: reductions in one order, bit-identical on reruns (SRPO_GATE_THREADS=2 measures how far
        # another reduction order, a stand-in for another CPU's rounding, moves the gated values)
        "OMP_NUM_THREADS": os.environ.get("SRPO_GATE_THREADS", "1"),
        "MKL_NUM_THREADS": os.environ.get("SRPO_GATE_THREADS", "1"),
        "PYTHONHASHSEED": "0",
        "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ['PYTHONPATH']}"
        if os.environ.get("PYTHONPATH")
        else str(REPO),
    }
    log = work / "train.log"
    t0 = time.monotonic()
    with log.open("w") as out:
        proc = subprocess.run(
            [sys.executable, *entry, *args], env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT
        )
    tail = log.read_text(errors="replace")[-4000:]
    if proc.returncode != 0:
        raise SystemExit(f"gate: the gated run failed (exit {proc.returncode}); its log is {log}:\n{tail}")
    print(f"[gate] gated run: {time.monotonic() - t0:.0f} s, log {log}", flush=True)
    return read_run(run_dir, log)


def read_run(run_dir: Path, log: Path) -> dict[str, dict[int, float]]:
    series: dict[str, dict[int, float]] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        for key, value in row.items():
            if key != "step" and isinstance(value, int | float) and not isinstance(value, bool):
                series.setdefault(key, {})[int(row["step"])] = float(value)
    # Held-out accuracy: the train command's summary line (before / after: avg@k and greedy).
    summary = None
    for line in log.read_text(errors="replace").splitlines():
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            with contextlib.suppress(json.JSONDecodeError):
                summary = json.loads(line)
    if not summary or "before" not in summary or "after" not in summary:
        raise SystemExit(f"gate: the gated run printed no summary with held-out accuracy (see {log})")
    for point in (summary["before"], summary["after"]):
        for key, value in point.items():
            if key != "step":
                series.setdefault(f"eval/{key}", {})[int(point["step"])] = float(value)
    return series


def load_tolerances(path: Path = TOLERANCES) -> dict[str, dict[str, float]]:
    tol = json.loads(path.read_text())
    tol.pop("_comment", None)
    for key, t in tol.items():
        if set(t) - {"abs", "rel", "why"} or not {"abs", "rel"} <= set(t):
            raise SystemExit(
                f"gate: {path}: {key} needs 'abs' and 'rel' (and an optional 'why'), got {sorted(t)}"
            )
    return tol


def compare(
    run: dict[str, dict[int, float]],
    history: dict[str, dict[str, float]],
    tolerances: dict[str, dict[str, float]],
) -> tuple[list[Moved], list[Moved]]:
    """(moved, every compared value) of the gated metrics; the band is history ± (abs + rel·|history|)."""
    missing = sorted(set(tolerances) - set(history))
    if missing:
        raise SystemExit(
            f"gate: {HISTORY} has no history for gated metrics {missing}; run `tools/dev gate --update` and "
            "review the diff"
        )
    moved, compared = [], []
    for metric, tol in tolerances.items():
        for step_s, expected in history[metric].items():
            step = int(step_s)
            half = tol["abs"] + tol["rel"] * abs(expected)
            value = run.get(metric, {}).get(step)
            m = Moved(metric, step, value, expected, half)
            compared.append(m)
            if m.widths > 1.0:
                moved.append(m)
    return moved, compared


def table(moved: list[Moved], per_metric: int = 3) -> str:
    """What moved, one row per (metric, step): the first ``per_metric`` steps of each metric, then a count."""
    head = f"{'metric':<24} {'step':>4} {'value':>14} {'band':>33} {'off by':>10}"
    lines = [head, "-" * len(head)]
    by_metric: dict[str, list[Moved]] = {}
    for m in moved:
        by_metric.setdefault(m.metric, []).append(m)
    for rows in by_metric.values():
        for m in rows[:per_metric]:
            lo, hi = m.band
            value = "missing" if m.value is None else f"{m.value:.7g}"
            lines.append(
                f"{m.metric:<24} {m.step:>4} {value:>14} [{lo:>14.7g}, {hi:>14.7g}] {m.widths:>8.3g}bw"
            )
        if len(rows) > per_metric:
            lines.append(f"{'':<24} {'':>4} (+{len(rows) - per_metric} more steps of {rows[0].metric})")
    lines.append("bw: distance from the history value in band half-widths (abs + rel·|history|); > 1 fails")
    return "\n".join(lines)


def plot_moved(
    moved: list[Moved],
    run: dict[str, dict[int, float]],
    history: dict[str, dict[str, float]],
    tolerances: dict[str, dict[str, float]],
    out: Path,
) -> list[Path]:
    """One PNG per moved metric: the history with its band and this run's curve."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for metric in dict.fromkeys(m.metric for m in moved):
        steps = sorted(int(s) for s in history[metric])
        exp = [history[metric][str(s)] for s in steps]
        half = [tolerances[metric]["abs"] + tolerances[metric]["rel"] * abs(e) for e in exp]
        fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
        ax.fill_between(
            steps,
            [e - h for e, h in zip(exp, half, strict=True)],
            [e + h for e, h in zip(exp, half, strict=True)],
            alpha=0.25,
            color="tab:green",
            label="band (history ± tolerance)",
        )
        ax.plot(steps, exp, marker="o", markersize=3, color="tab:green", label="history")
        got = sorted(run.get(metric, {}).items())
        if got:
            ax.plot(
                [s for s, _ in got],
                [v for _, v in got],
                marker="o",
                markersize=3,
                color="tab:red",
                label="this run",
            )
        for m in moved:
            if m.metric == metric and m.value is not None:
                ax.annotate(
                    f"step {m.step}",
                    (m.step, m.value),
                    xytext=(4, 4),
                    textcoords="offset points",
                    fontsize=8,
                    color="tab:red",
                )
        ax.set_title(f"gate: {metric} moved outside its band")
        ax.set_xlabel("training step")
        ax.set_ylabel(metric)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8, loc="best", frameon=False)
        fig.tight_layout()
        path = out / (metric.replace("/", "__").replace("@", "at") + ".png")
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths


def write_history(run: dict[str, dict[int, float]], tolerances: dict[str, dict[str, float]]) -> None:
    """Rewrite ``HISTORY`` from ``run`` (every gated metric at every step it logged), atomically."""
    absent = sorted(k for k in tolerances if not run.get(k))
    if absent:
        raise SystemExit(
            f"gate --update: the gated run logged no {absent}; fix the run or drop them from {TOLERANCES}"
        )
    doc = {
        "_comment": "Written by `tools/dev gate --update` (srpo_megatron/testing/gate.py); review the diff "
        "like code. Per gated metric, {step: value} of the accepted gated run.",
        "run": {"recipe": str(RECIPE.relative_to(REPO)), "overrides": RUN_OVERRIDES, "head_std": HEAD_STD},
        "metrics": {k: {str(s): v for s, v in sorted(run[k].items())} for k in tolerances},
    }
    tmp = HISTORY.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(HISTORY)
    print(
        f"[gate] wrote {HISTORY} ({len(tolerances)} metrics); review `git diff {HISTORY.relative_to(REPO)}`"
    )


def main(argv: list[str] | None = None) -> int:
    from srpo_megatron.testing.gate_plants import PLANTS

    p = argparse.ArgumentParser(prog="tools/dev gate", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "-o",
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="recipe override applied to the gated run (e.g. loss.beta=0)",
    )
    p.add_argument("--plant", choices=PLANTS, help="run with a planted regression (the gate must fail)")
    p.add_argument("--update", action="store_true", help="rewrite the history from this run")
    p.add_argument("--out", default=str(REPO / "runs" / "gate"), help="work dir: inputs, run, log, PNGs")
    args = p.parse_args(argv)
    out = Path(args.out)
    tolerances = load_tolerances()
    if args.update and (args.plant or args.override):
        raise SystemExit(
            "gate: --update records the gated run as committed; with --plant or -o it would record a changed "
            "run (change RUN_OVERRIDES in srpo_megatron/testing/gate.py instead)"
        )
    run = run_gated(out, args.override, args.plant)
    if args.update:
        write_history(run, tolerances)
        return 0
    history = json.loads(HISTORY.read_text())["metrics"]
    moved, compared = compare(run, history, tolerances)
    far = max(compared, key=lambda m: m.widths)
    if not moved:
        print(
            f"[gate] PASS: {len(compared)} gated values in band (farthest from history: {far.metric} step "
            f"{far.step} at {far.widths:.3g} band widths)"
        )
        return 0
    print(
        f"[gate] FAIL: {len(moved)} of {len(compared)} gated values outside their bands "
        f"(band = history ± (abs + rel·|history|), {TOLERANCES.relative_to(REPO)}):"
    )
    print(table(moved))
    print(
        f"[gate] largest move: {far.metric} step {far.step} at {far.widths:.3g} band widths; "
        f"metrics moved: {', '.join(dict.fromkeys(m.metric for m in moved))}"
    )
    for path in plot_moved(moved, run, history, tolerances, out / "moved"):
        print(f"[gate] wrote {path}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
