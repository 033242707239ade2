"""The CPU study of issue 16: SRPO vs GRPO vs SDPO and ablations, with seeds, paired differences, curves.

One command trains every (mode, seed) with ``srpo train`` on ``study_arith_cpu.yaml`` and then writes
``<out>/results.md``, ``<out>/results.json`` and ``<out>/curves.png``:

    nice -n 10 .venv/bin/python examples/cpu_compare/study.py --out runs/study

- Modes: srpo, grpo, sdpo, srpo_no_dw, sdpo_incorrect_only, sdpo_correct_only (``srpo_megatron.losses``).
- Learning rates: the paper's ratios around ``--lr`` (SRPO's): GRPO = lr ÷ 5 with 4 mini-batches per
  rollout batch, SDPO and both Fig. 1(b) variants = 2 × lr, SRPO without dynamic weights = lr.
  ``--lr-scales 0.5 1 2`` adds a per-method sweep (each scale multiplies every method's lr).
- Evaluation: avg@k (k = 8, T = 0.6, top-p 0.95) on ``--eval-problems`` held-out problems every
  ``--eval-every`` steps and after the last step. The starting weights are evaluated once per seed (in
  the first mode's run; the step-0 weights and eval seed are the same for every mode of a seed) and that
  evaluation is every mode's step 0. Each seed uses its own eval sampling seed.
- Scores per run: *final* (after the last step) and *best* (the highest of the evaluations after step
  0; optimistic, since the best step is chosen on the same problems).
- Paired differences A − B: per seed (same seed = same data order and eval samples seed), with two
  standard errors: over seeds (training + evaluation noise, needs ≥ 2 seeds) and over problems (the
  per-problem difference averaged over seeds; evaluation noise only).
- Resumable: a run whose ``eval_log.jsonl`` already holds its last step is skipped, an interrupted one
  resumes from its checkpoint (``srpo train`` does), and the analysis reads only the files. Checkpoints of
  finished runs are deleted (``--keep-checkpoints`` keeps them).
- ``--smoke`` runs the whole pipeline on a tiny random Qwen3 (``srpo_megatron.testing.tiny``) with a
  reward that is right for about half the responses (so groups are mixed): the CI check that the table
  and plots are written, nothing about the method.

Prerequisite (not for --smoke): the demo's prepared model (``tools/demo.sh`` once, or
tools/prepare_smollm2.py + tools/convert_hf_to_megatron.py into .cache/).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODES = ("srpo", "grpo", "sdpo", "srpo_no_dw", "sdpo_incorrect_only", "sdpo_correct_only")
# The paper's lr ratios to SRPO's, and GRPO's mini-batches (method §4).
LR_RATIO = {"grpo": 0.2, "sdpo": 2.0, "sdpo_incorrect_only": 2.0, "sdpo_correct_only": 2.0}
MINI_BATCHES = {"grpo": 4}
# Pairs reported as differences A − B (the claims of issue 16 read from them).
PAIRS = (
    ("srpo", "grpo"),
    ("srpo", "sdpo"),
    ("sdpo", "grpo"),
    ("srpo", "srpo_no_dw"),
    ("sdpo_incorrect_only", "sdpo"),
    ("sdpo_correct_only", "sdpo"),
    ("sdpo_incorrect_only", "sdpo_correct_only"),
)
# Seconds on 2 idle cores, projected from a short run measured on the shared machine (examples/cpu_compare/
# README.md): CPU seconds ÷ 2 threads. One SRPO step of 8 × 4 rollouts ≤ 64 tokens: ~105 CPU s; one evaluation
# sequence (≤ 64 tokens): ~1.6 CPU s. Likely upper bounds (OpenMP spin-waits inflate CPU time under load).
STEP_S = 55.0
EVAL_SEQ_S = 0.8
RUN_OVERHEAD_S = 60.0
CURVES = (  # metrics.jsonl key(s), axis label; the first key present is used
    (("reward/accuracy",), "training reward accuracy"),
    (("teacher/entropy_mean",), "teacher token entropy (SDPO tokens)"),
    (("route/sdpo_loss_frac", "route/sdpo_frac"), "share of samples taking the SDPO loss"),
    (("response/length_mean",), "mean response length (tokens)"),
)
COLORS = {
    "srpo": "tab:red",
    "grpo": "tab:blue",
    "sdpo": "tab:green",
    "srpo_no_dw": "tab:orange",
    "sdpo_incorrect_only": "tab:purple",
    "sdpo_correct_only": "tab:brown",
}


# ------------------------------------------------------------------------------------------ running


def run_name(mode: str, seed: int, scale: float) -> str:
    return f"{mode}_s{seed}" + ("" if scale == 1.0 else f"_lr{scale:g}")


def mode_lr(mode: str, base_lr: float, scale: float) -> float:
    return base_lr * LR_RATIO.get(mode, 1.0) * scale


def eval_log(run_dir: Path) -> dict[int, dict]:
    """step -> eval line, the last line per step winning (a resumed run may repeat an evaluation)."""
    path = run_dir / "eval_log.jsonl"
    if not path.is_file():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        if line.strip():
            e = json.loads(line)
            out[int(e["step"])] = e
    return out


def _srpo_cmd(args: argparse.Namespace) -> list[str]:
    exe = ROOT / ".venv/bin/srpo"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "srpo_megatron.cli"]


def train_run(mode: str, seed: int, scale: float, first_of_seed: bool, args: argparse.Namespace) -> Path:
    """Train one (mode, seed, lr scale) unless its last evaluation is already written; returns its dir."""
    run_dir = Path(args.out) / run_name(mode, seed, scale)
    log = eval_log(run_dir)
    if args.steps in log and (not first_of_seed or 0 in log):
        return run_dir
    overrides = [
        f"loss.mode={mode}",
        f"optim.lr={mode_lr(mode, args.lr, scale)}",
        f"train.mini_batches={MINI_BATCHES.get(mode, 1)}",
        f"run.seed={seed}",
        f"run.dir={run_dir}",
        f"eval.seed={1000 + seed}",
        f"train.steps={args.steps}",
        f"eval.every_n_steps={args.eval_every}",
        f"eval.k={args.eval_k}",
        f"eval.max_prompts_per_benchmark={args.eval_problems}",
        f"data.arithmetic.num_eval={args.eval_problems}",
        "train.eval_at_ends=true",
        f"train.eval_at_start={str(first_of_seed).lower()}",
        *args.smoke_overrides,
        *args.extra,
    ]
    cmd = _srpo_cmd(args) + ["train", args.recipe] + [x for o in overrides for x in ("--override", o)]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{os.environ.get('PYTHONPATH', '')}")
    print("[study] " + " ".join(cmd), flush=True)
    t0 = time.monotonic()
    subprocess.run(cmd, cwd=ROOT, env=env, check=True)
    print(f"[study] {run_dir.name}: {time.monotonic() - t0:.0f} s", flush=True)
    if not args.keep_checkpoints:
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return run_dir


def smoke_setup(args: argparse.Namespace) -> None:
    """Tiny random Qwen3 + a coin-flip verifier for the arithmetic rows: fast, and groups are mixed."""
    from srpo_megatron.testing.tiny import write_tiny_qwen3

    hf = write_tiny_qwen3(Path(args.out) / "tiny-qwen3")
    args.smoke_overrides = [
        f"model.hf_dir={hf}",
        "model.megatron_checkpoint=null",
        "model.max_sequence_length=256",
        "rollout.prompts_per_step=4",
        "rollout.max_new_tokens=6",
        "rollout.reward_fns={arithmetic: 'srpo_megatron.testing.tiny:coin_reward'}",
        "eval.max_new_tokens=6",
        "train.micro_batch_size=16",
        "run.save_every=0",
        "data.arithmetic.num_train=64",
        "teacher.max_prompt_tokens=160",
        "loss.top_k=4",
    ]


def plan(args: argparse.Namespace) -> dict:
    """The study's workload and its projected wall time on 2 idle cores (rates from a measured short run)."""
    runs = len(args.modes) * len(args.seeds) * len(args.lr_scales)
    evals_per_run = (args.steps - 1) // args.eval_every + 1  # every N steps before the last, then the last
    evals = runs * evals_per_run + len(args.seeds) * len(args.lr_scales)  # + one shared step 0 per seed
    eval_seqs = evals * args.eval_problems * args.eval_k
    step_s = {m: args.step_seconds * (args.grpo_step_factor if m == "grpo" else 1.0) for m in args.modes}
    train_s = sum(step_s[m] for m in args.modes) * len(args.seeds) * len(args.lr_scales) * args.steps
    eval_s = eval_seqs * args.eval_seq_seconds
    return {
        "runs": runs,
        "train_steps": runs * args.steps,
        "evaluations": evals,
        "eval_sequences": eval_seqs,
        "projected_hours": round((train_s + eval_s + runs * args.run_overhead_seconds) / 3600, 2),
        "rates": {
            "step_s": args.step_seconds,
            "eval_seq_s": args.eval_seq_seconds,
            "run_overhead_s": args.run_overhead_seconds,
        },
    }


# ------------------------------------------------------------------------------------------ analysis


def per_problem(run_dir: Path, step: int) -> list[float] | None:
    """Mean reward of each held-out problem (over its k samples) at ``step``, or None if not evaluated."""
    path = run_dir / "eval" / f"step_{step:06d}" / "avg_at_k" / "samples.jsonl"
    if not path.is_file():
        return None
    sums: dict[tuple[str, int], list[float]] = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        sums.setdefault((r["benchmark"], r["prompt_index"]), []).append(float(r["reward"]))
    return [sum(v) / len(v) for _, v in sorted(sums.items())]


def metric_curve(run_dir: Path, keys: tuple[str, ...]) -> list[tuple[int, float]]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    out = {}
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        m = json.loads(line)
        v = next((m[k] for k in keys if m.get(k) is not None), None)
        if v is not None and math.isfinite(float(v)):
            out[int(m["step"])] = float(v)
    return sorted(out.items())


def mean_se(xs: list[float]) -> tuple[float | None, float | None]:
    """Mean and its standard error (sample sd / √n; None for n < 2)."""
    if not xs:
        return None, None
    m = sum(xs) / len(xs)
    if len(xs) < 2:
        return m, None
    var = sum((x - m) ** 2 for x in xs) / (len(xs) - 1)
    return m, math.sqrt(var / len(xs))


def collect(out: Path, modes: list[str], seeds: list[int], scales: list[float]) -> dict:
    """Everything the table and plots need, read from the run directories only."""
    runs: dict[str, dict] = {}
    for scale in scales:
        for seed in seeds:
            base = None  # the seed's shared step-0 evaluation
            for mode in modes:
                log = eval_log(out / run_name(mode, seed, scale))
                if 0 in log:
                    base = per_problem(out / run_name(mode, seed, scale), 0)
                    break
            for mode in modes:
                run_dir = out / run_name(mode, seed, scale)
                log = eval_log(run_dir)
                if not log:
                    continue
                problems = {s: per_problem(run_dir, s) for s in sorted(log) if s > 0}
                problems = {s: p for s, p in problems.items() if p}
                if base:
                    problems[0] = base
                acc = {s: sum(p) / len(p) for s, p in sorted(problems.items())}
                trained = {s: a for s, a in acc.items() if s > 0}
                final_step = max(trained) if trained else None
                best_step = max(trained, key=lambda s: (trained[s], -s)) if trained else None
                runs[run_name(mode, seed, scale)] = {
                    "mode": mode,
                    "seed": seed,
                    "lr_scale": scale,
                    "accuracy": {str(s): a for s, a in acc.items()},
                    "final_step": final_step,
                    "best_step": best_step,
                    "problems": {str(s): p for s, p in problems.items()},
                    "curves": {keys[0]: metric_curve(run_dir, keys) for keys, _ in CURVES},
                    "train_s": sum(v for _, v in metric_curve(run_dir, ("time/step_s",))),
                }
    return runs


def summarize(runs: dict, modes: list[str], seeds: list[int], scales: list[float]) -> dict:
    def pick(mode, seed, scale, which):
        r = runs.get(run_name(mode, seed, scale))
        if not r or r[f"{which}_step"] is None:
            return None, None
        s = str(r[f"{which}_step"])
        return r["accuracy"][s], r["problems"][s]

    table, pairs = [], []
    for scale in scales:
        for mode in modes:
            row = {"mode": mode, "lr_scale": scale, "seeds": 0}
            for which in ("final", "best"):
                vals = [v for s in seeds if (v := pick(mode, s, scale, which)[0]) is not None]
                row["seeds"] = max(row["seeds"], len(vals))
                row[which], row[f"{which}_se"] = mean_se(vals)
            base = [runs[n]["accuracy"].get("0") for s in seeds if (n := run_name(mode, s, scale)) in runs]
            row["step0"] = mean_se([b for b in base if b is not None])[0]
            table.append(row)
        for a, b in PAIRS:
            if a not in modes or b not in modes:
                continue
            for which in ("final", "best"):
                d_seed, d_prob = [], None
                for s in seeds:
                    (va, pa), (vb, pb) = pick(a, s, scale, which), pick(b, s, scale, which)
                    if va is None or vb is None or len(pa) != len(pb):
                        continue
                    d_seed.append(va - vb)
                    diff = [x - y for x, y in zip(pa, pb, strict=True)]
                    d_prob = diff if d_prob is None else [x + y for x, y in zip(d_prob, diff, strict=True)]
                if not d_seed:
                    continue
                mean, se_seeds = mean_se(d_seed)
                _, se_problems = mean_se([x / len(d_seed) for x in d_prob])
                pairs.append(
                    {
                        "a": a,
                        "b": b,
                        "lr_scale": scale,
                        "which": which,
                        "diff": mean,
                        "se_seeds": se_seeds,
                        "se_problems": se_problems,
                        "seeds": len(d_seed),
                        "per_seed": d_seed,
                    }
                )
    return {"table": table, "pairs": pairs, "claims": claims(runs, pairs, modes, seeds)}


def _verdict(diff: float | None, se: float | None, sign: int) -> str:
    """'supported' if sign·diff > 2 SE, 'contradicted' if sign·diff < −2 SE, else 'not supported'."""
    if diff is None or se is None:
        return "undetermined (needs >= 2 seeds)"
    if sign * diff > 2 * se:
        return "supported"
    return "contradicted" if sign * diff < -2 * se else "not supported (within 2 SE)"


def claims(runs: dict, pairs: list[dict], modes: list[str], seeds: list[int]) -> list[dict]:
    """The four claims of issue 16, each with its numbers and a mechanical verdict (±2 SE over seeds)."""

    def pair(a, b, which="final"):
        return next(
            (p for p in pairs if (p["a"], p["b"], p["which"], p["lr_scale"]) == (a, b, which, 1.0)), None
        )

    def early_vs_final(mode):  # first trained evaluation minus the final one, per seed
        out = []
        for s in seeds:
            r = runs.get(run_name(mode, s, 1.0))
            if r and r["final_step"] is not None:
                trained = sorted(int(k) for k in r["accuracy"] if int(k) > 0)
                out.append(r["accuracy"][str(r["final_step"])] - r["accuracy"][str(trained[0])])
        return mean_se(out)

    def entropy_rise(mode):  # mean teacher entropy over the last third of steps minus the first third
        out = []
        for s in seeds:
            r = runs.get(run_name(mode, s, 1.0))
            curve = [v for _, v in (r or {}).get("curves", {}).get("teacher/entropy_mean", [])]
            if len(curve) >= 3:
                n = len(curve) // 3
                out.append(sum(curve[-n:]) / n - sum(curve[:n]) / n)
        return mean_se(out)

    rows = []

    def add(claim, what, diff, se, sign):
        rows.append(
            {
                "claim": claim,
                "measure": what,
                "value": diff,
                "se_seeds": se,
                "verdict": _verdict(diff, se, sign),
            }
        )

    if (p := pair("srpo", "grpo")) is not None:
        add("1a SRPO beats GRPO in the end", "final avg@k, SRPO − GRPO", p["diff"], p["se_seeds"], +1)
    if "sdpo" in modes and "srpo" in modes:
        first = []
        for s in seeds:
            ra, rb = runs.get(run_name("sdpo", s, 1.0)), runs.get(run_name("srpo", s, 1.0))
            if ra and rb:
                steps = sorted(int(k) for k in ra["accuracy"] if int(k) > 0 and k in rb["accuracy"])
                if steps:
                    first.append(ra["accuracy"][str(steps[0])] - rb["accuracy"][str(steps[0])])
        m, se = mean_se(first)
        add("1b SDPO improves faster early", "avg@k at the first evaluation, SDPO − SRPO", m, se, +1)
        m, se = early_vs_final("sdpo")
        add("1c SDPO then saturates or collapses", "SDPO final − SDPO first evaluation (≤ 0)", m, se, -1)
    if (p := pair("srpo", "srpo_no_dw")) is not None:
        add(
            "2 dynamic weights help", "final avg@k, SRPO − SRPO without weights", p["diff"], p["se_seeds"], +1
        )
    if (p := pair("sdpo_incorrect_only", "sdpo_correct_only")) is not None:
        add(
            "3 incorrect-only beats correct-only",
            "final, incorrect-only − correct-only",
            p["diff"],
            p["se_seeds"],
            +1,
        )
    if (p := pair("sdpo_correct_only", "sdpo")) is not None:
        add("3 correct-only degrades", "final, correct-only − SDPO", p["diff"], p["se_seeds"], -1)
    for mode in ("srpo", "sdpo"):
        if mode in modes:
            m, se = entropy_rise(mode)
            add(f"4 teacher entropy rises ({mode})", "entropy, last third − first third of steps", m, se, +1)
    return rows


# ------------------------------------------------------------------------------------------ output


def _fmt(v: float | None, se: float | None = None) -> str:
    if v is None:
        return "–"
    return f"{v:.3f}" if se is None else f"{v:.3f} ± {se:.3f}"


def write_markdown(summary: dict, meta: dict, path: Path) -> None:
    lines = [
        "# CPU study results (examples/cpu_compare/study.py)",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"Seeds {meta['seeds']}, {meta['steps']} steps, avg@{meta['eval_k']} on {meta['eval_problems']} "
        f"held-out problems every {meta['eval_every']} steps; SRPO lr {meta['lr']:g} "
        f"(ratios: {meta['lr_ratios']}, mini-batches: {meta['mini_batches']}). "
        f"Training wall time of all runs: {meta['train_s_total']:.0f} s (sum of step times, no evaluations).",
        "",
        "## Accuracy per mode (mean over seeds ± SE over seeds)",
        "",
        "| mode | lr scale | seeds | step 0 | final | best (steps > 0) |",
        "|---|---|---|---|---|---|",
    ]
    for r in summary["table"]:
        lines.append(
            f"| {r['mode']} | {r['lr_scale']:g} | {r['seeds']} | {_fmt(r['step0'])} | "
            f"{_fmt(r['final'], r['final_se'])} | {_fmt(r['best'], r['best_se'])} |"
        )
    lines += [
        "",
        "## Paired differences A − B (same seed)",
        "",
        "SE over seeds: training and evaluation noise; SE over problems: per-problem differences averaged "
        "over seeds (evaluation noise only).",
        "",
        "| A | B | lr scale | score | A − B | SE seeds | SE problems | per seed |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in summary["pairs"]:
        per_seed = ", ".join(f"{d:+.3f}" for d in p["per_seed"])
        lines.append(
            f"| {p['a']} | {p['b']} | {p['lr_scale']:g} | {p['which']} | {p['diff']:+.3f} | "
            f"{_fmt(p['se_seeds'])} | {_fmt(p['se_problems'])} | {per_seed} |"
        )
    lines += [
        "",
        "## Claims (verdict rule: the difference exceeds 2 SE over seeds in the claimed direction)",
        "",
        "| claim | measure | value | SE seeds | verdict |",
        "|---|---|---|---|---|",
    ]
    for c in summary["claims"]:
        lines.append(
            f"| {c['claim']} | {c['measure']} | {_fmt(c['value'])} | {_fmt(c['se_seeds'])} | {c['verdict']} |"
        )
    lines += ["", "Curves: `curves.png` (held-out avg@k, teacher entropy, SDPO share, response length).", ""]
    path.write_text("\n".join(lines))


def plot(runs: dict, modes: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(16, 8.5))
    panels = [("accuracy", "held-out avg@k (T = 0.6)")] + [(keys[0], label) for keys, label in CURVES]
    for ax, (key, label) in zip(axes.flat, panels, strict=False):
        for mode in modes:
            series = []
            for r in runs.values():
                if r["mode"] != mode or r["lr_scale"] != 1.0:
                    continue
                pts = (
                    sorted((int(s), a) for s, a in r["accuracy"].items())
                    if key == "accuracy"
                    else r["curves"][key]
                )
                if pts:
                    series.append(dict(pts))
                    ax.plot(*zip(*pts, strict=True), color=COLORS.get(mode), alpha=0.25, linewidth=1)
            if series:
                steps = sorted(set.intersection(*(set(s) for s in series)))
                ys = [sum(s[x] for s in series) / len(series) for x in steps]
                ax.plot(
                    steps,
                    ys,
                    "o-" if key == "accuracy" else "-",
                    color=COLORS.get(mode),
                    markersize=3,
                    label=f"{mode} ({len(series)} seeds)",
                )
        ax.set_xlabel("training step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=7)
    axes.flat[-1].axis("off")
    fig.suptitle(
        "CPU study: SmolLM2-135M-Instruct, arithmetic with reasoning (mean over seeds; thin: single seeds)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipe", default="examples/cpu_compare/study_arith_cpu.yaml")
    p.add_argument("--out", default="runs/study", help="parent of the per-run directories and the results")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument(
        "--eval-every", type=int, default=10, help="held-out evaluation every N steps (and at the end)"
    )
    p.add_argument("--eval-problems", type=int, default=256)
    p.add_argument("--eval-k", type=int, default=8)
    p.add_argument(
        "--lr", type=float, default=1e-5, help="SRPO's learning rate; the others follow the ratios"
    )
    p.add_argument("--lr-scales", nargs="+", type=float, default=[1.0], help="per-method sweep multipliers")
    p.add_argument("--extra", nargs="*", default=[], help="more key=value overrides for every run")
    p.add_argument("--analyze-only", action="store_true", help="only rebuild the table and plots")
    p.add_argument("--keep-checkpoints", action="store_true")
    p.add_argument("--smoke", action="store_true", help="tiny random model, for CI (says nothing about SRPO)")
    # Rates on 2 idle cores for the projection (examples/cpu_compare/README.md: how they were measured).
    p.add_argument("--step-seconds", type=float, default=STEP_S, help="one SRPO training step")
    p.add_argument("--grpo-step-factor", type=float, default=0.8, help="GRPO step / SRPO step (no teacher)")
    p.add_argument("--eval-seq-seconds", type=float, default=EVAL_SEQ_S, help="one evaluation sequence")
    p.add_argument("--run-overhead-seconds", type=float, default=RUN_OVERHEAD_S, help="start-up + checkpoint")
    p.add_argument("--plan", action="store_true", help="print the workload and projected hours, then exit")
    args = p.parse_args(argv)
    args.smoke_overrides = []
    work = plan(args)
    print("[study] plan: " + json.dumps(work), flush=True)
    if args.plan:
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        smoke_setup(args)
    elif not args.analyze_only and not (ROOT / ".cache/smollm2-mcore").exists() and not args.extra:
        raise SystemExit("no .cache/smollm2-mcore: run tools/demo.sh once (prepares and converts SmolLM2)")

    t0 = time.monotonic()
    if not args.analyze_only:
        for scale in args.lr_scales:
            for seed in args.seeds:
                for i, mode in enumerate(args.modes):
                    train_run(mode, seed, scale, i == 0, args)
    runs = collect(out, args.modes, args.seeds, args.lr_scales)
    summary = summarize(runs, args.modes, args.seeds, args.lr_scales)
    meta = {
        "command": " ".join(["examples/cpu_compare/study.py", *(argv if argv is not None else sys.argv[1:])]),
        "modes": args.modes,
        "seeds": args.seeds,
        "steps": args.steps,
        "eval_every": args.eval_every,
        "eval_problems": args.eval_problems,
        "eval_k": args.eval_k,
        "lr": args.lr,
        "lr_scales": args.lr_scales,
        "lr_ratios": {m: LR_RATIO.get(m, 1.0) for m in args.modes},
        "mini_batches": {m: MINI_BATCHES.get(m, 1) for m in args.modes},
        "smoke": args.smoke,
        "plan": work,
        "train_s_total": sum(r["train_s"] for r in runs.values()),
        "this_invocation_s": round(time.monotonic() - t0, 1),
    }
    (out / "results.json").write_text(json.dumps({"meta": meta, **summary, "runs": runs}, indent=1) + "\n")
    write_markdown(summary, meta, out / "results.md")
    plot(runs, args.modes, out / "curves.png")
    print(
        json.dumps({"results": str(out / "results.md"), "plot": str(out / "curves.png"), "runs": len(runs)})
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
