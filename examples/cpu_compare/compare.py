"""SRPO vs GRPO vs SDPO from the same code on the CPU arithmetic task: same recipe, data and seeds.

Each (mode, seed) is one ``srpo train examples/smollm2_arith_cpu.yaml`` with ``loss.mode=<mode>``,
``run.seed=<seed>`` and held-out evaluation every ``--eval-every`` steps, in its own run directory
``<out>/<mode>_s<seed>``. Runs whose ``eval_log.jsonl`` already reaches the last step are not rerun,
so the script can be resumed. Then one PNG, ``<out>/compare.png``, shows held-out avg@k and greedy
accuracy against step (left) and against training wall-clock (right), one line per mode (mean over
seeds; thin lines are the single seeds).

The optimizer settings are the demo's for every mode (the paper tunes lr per method: GRPO 1e-6,
SDPO 1e-5, SRPO 5e-6; pass e.g. ``--extra optim.lr=1e-5`` to change them for all). Prerequisite: the
demo's prepared model (``tools/demo.sh`` once, or tools/prepare_smollm2.py + convert_hf_to_megatron.py).

    .venv/bin/python examples/cpu_compare/compare.py --seeds 1 2 --steps 12 --eval-every 4
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODES = ("srpo", "grpo", "sdpo")


def _eval_points(run_dir: Path) -> list[dict]:
    """One point per evaluation: step, elapsed seconds, avg@k and (if written) greedy accuracy."""
    log = run_dir / "eval_log.jsonl"
    if not log.is_file():
        return []
    points = []
    for line in log.read_text().splitlines():
        if not line.strip():
            continue
        e = json.loads(line)
        greedy_file = run_dir / "eval" / f"step_{e['step']:06d}" / "greedy" / "summary.json"
        greedy = json.loads(greedy_file.read_text())["mean_avg_at_k"] if greedy_file.is_file() else None
        points.append(
            {"step": e["step"], "elapsed_s": e["elapsed_s"], "avg_at_k": e["mean_avg_at_k"], "greedy": greedy}
        )
    return points


def _train(mode: str, seed: int, run_dir: Path, args: argparse.Namespace) -> None:
    cmd = [args.srpo] if args.srpo else [sys.executable, "-m", "srpo_megatron.cli"]
    overrides = [
        "model.hf_dir=.cache/smollm2-hf",
        "model.megatron_checkpoint=.cache/smollm2-mcore",
        f"loss.mode={mode}",
        f"run.seed={seed}",
        f"run.dir={run_dir}",
        f"train.steps={args.steps}",
        f"eval.every_n_steps={args.eval_every}",
        *args.extra,
    ]
    cmd += ["train", args.recipe] + [x for o in overrides for x in ("--override", o)]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{os.environ.get('PYTHONPATH', '')}")
    print("[compare] " + " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)


def plot(runs: dict[tuple[str, int], list[dict]], out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(12, 8), sharey="row")
    colors = {"srpo": "tab:red", "grpo": "tab:blue", "sdpo": "tab:green"}
    for row, metric in enumerate(("avg_at_k", "greedy")):
        for col, x in enumerate(("step", "elapsed_s")):
            ax = axes[row][col]
            for mode in MODES:
                seeds = [pts for (m, _), pts in sorted(runs.items()) if m == mode and pts]
                for pts in seeds:
                    xs = [p[x] for p in pts if p[metric] is not None]
                    ys = [p[metric] for p in pts if p[metric] is not None]
                    ax.plot(xs, ys, color=colors[mode], alpha=0.3, linewidth=1)
                if seeds:
                    n = min(len(p) for p in seeds)
                    xs = [sum(p[i][x] for p in seeds) / len(seeds) for i in range(n)]
                    vals = [[p[i][metric] for p in seeds] for i in range(n)]
                    ys = [sum(v) / len(v) if None not in v else float("nan") for v in vals]
                    ax.plot(xs, ys, "o-", color=colors[mode], label=f"{mode} (mean of {len(seeds)} seeds)")
            ax.set_xlabel("training step" if x == "step" else "wall-clock since start (s)")
            ax.set_ylabel("held-out " + ("avg@k (T=0.6)" if metric == "avg_at_k" else "greedy accuracy"))
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle("SmolLM2-135M-Instruct, synthetic arithmetic (CPU): SRPO vs GRPO vs SDPO")
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="examples/smollm2_arith_cpu.yaml")
    p.add_argument("--out", default="runs/cpu_compare", help="parent of the per-run directories")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--seeds", nargs="+", type=int, default=[1])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--eval-every", type=int, default=4, help="held-out evaluation every N steps")
    p.add_argument("--extra", nargs="*", default=[], help="more key=value overrides for every run")
    p.add_argument("--plot-only", action="store_true", help="only redraw the PNG from existing runs")
    installed = ROOT / ".venv/bin/srpo"
    p.add_argument("--srpo", default=str(installed) if installed.exists() else "", help="srpo executable")
    args = p.parse_args(argv)

    out = Path(args.out)
    runs: dict[tuple[str, int], list[dict]] = {}
    for seed in args.seeds:
        for mode in args.modes:
            run_dir = out / f"{mode}_s{seed}"
            points = _eval_points(ROOT / run_dir)
            if not args.plot_only and not (points and points[-1]["step"] >= args.steps):
                _train(mode, seed, run_dir, args)
                points = _eval_points(ROOT / run_dir)
            runs[(mode, seed)] = points
    png = ROOT / out / "compare.png"
    plot(runs, png)
    final = {
        f"{m}_s{s}": {
            "steps": pts[-1]["step"],
            "elapsed_s": round(pts[-1]["elapsed_s"], 1),
            "avg_at_k": [pts[0]["avg_at_k"], pts[-1]["avg_at_k"]],
            "greedy": [pts[0]["greedy"], pts[-1]["greedy"]],
        }
        for (m, s), pts in runs.items()
        if pts
    }
    print(json.dumps({"plot": str(png), "runs": final}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
