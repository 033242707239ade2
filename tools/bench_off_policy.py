"""Benchmark: off-policy rollouts (``rollout.off_policy_steps``) against the synchronous step, on CPU.

Separate placement as on a cluster, shrunk to processes: the SGLang stand-in server
(``srpo_megatron.testing.standin_process``, one torch thread) is the engine node, and ``srpo train`` at
world 1 (``OMP_NUM_THREADS=1``) is the trainer, reaching the server through ``SRPO_ENGINE_URLS`` with
``weight_sync: distributed`` (gloo broadcast). The tiny recipe (``examples/tiny_cpu_test.yaml``) runs twice,
same seed, same sizes: ``rollout.off_policy_steps=0`` (generate, then train: the step is the sum of the two)
and ``=1`` (the engine generates the next batch while the trainer trains: the step should approach the
larger of the two). A fresh server serves each run.

Step time: the median, over the steps after the first, of the wall-clock gap between consecutive rows of
``metrics.jsonl`` (when each row appeared); ``time/step_s`` (the trainer's own figure) is printed beside it.
Idle share of process-seconds (two processes, one thread each): from ``async/engine_idle_share`` and
``async/trainer_idle_share`` when the run logs them, else from the phase times: engine busy =
``time/generate_s``, trainer busy = score + teacher + train + weight sync, each over ``time/step_s``. (At
N >= 1 a weight sync waits for the running generation to end, so that fallback counts such a wait as
busy; the logged ``async/trainer_idle_share`` counts only the waits for rollouts.)

The engine and the trainer get a core each (``os.sched_setaffinity``; ``--no-pin`` to share all cores):
separate devices, as the placement means (unpinned, the scheduler may run both on one core while other
processes hold the other). Each (N=0, N=1) pair runs back to back, order alternating, and the ratio is
the median of the pairs'.

Expected when generation and training take similar time: ``ratio_n1_vs_n0`` <= 0.65, near ``ideal_ratio``
(N=0's step with its two phases overlapped perfectly). The machine's load average is printed before and
after (other processes share these cores). Measured on 2 cores (load average 0.2 -> 3.1): N=0 11.34 s, N=1
7.14 s per step, ratio 0.632 (pairs 0.663 / 0.626 / 0.632; ideal 0.615), generate 4.4 s vs trainer 7.0 s,
idle share of process-seconds 0.50 -> 0.18.

Usage: ``python tools/bench_off_policy.py [--steps 5 --repeats 3 --max-new-tokens 48 --no-pin]``; the last
line is one JSON object (``step_s_n0``, ``step_s_n1``, ``ratio_n1_vs_n0``, idle shares, phase times).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "examples" / "tiny_cpu_test.yaml"
TRAINER_PHASES = ("time/score_s", "time/teacher_s", "time/train_s", "time/weight_sync_s")
IDLE_METRICS = ("async/engine_idle_share", "async/trainer_idle_share")


def steady(rows: list[dict]) -> list[dict]:
    """The steps after the first (the first pays for warm-up), or every step when there is only one."""
    return rows[1:] if len(rows) > 1 else rows


def wall_step_s(arrivals: list[float]) -> float | None:
    """Median gap between consecutive rows' arrival times (seconds), skipping the first step's row."""
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    return statistics.median(gaps) if gaps else None


def run_summary(rows: list[dict], arrivals: list[float]) -> dict:
    """One run's figures from its ``metrics.jsonl`` rows and the times they appeared (same length).

    Phase times and ``time/step_s`` are medians over the steady steps; idle shares are ratios of sums
    over them (``idle_from`` says whether the run logged them or they come from the phase times)."""
    use = steady(rows)
    median = lambda key: statistics.median(r[key] for r in use)  # noqa: E731
    out = {
        "steps": len(rows),
        "step_s_wall": wall_step_s(arrivals),
        "step_s_metric": median("time/step_s"),
        "generate_s": median("time/generate_s"),
        "trainer_busy_s": statistics.median(sum(r[k] for k in TRAINER_PHASES) for r in use),
        "train_s": median("time/train_s"),
    }
    if all(r.get(k) is not None for r in use for k in IDLE_METRICS):
        engine_idle = statistics.fmean(r["async/engine_idle_share"] for r in use)
        trainer_idle = statistics.fmean(r["async/trainer_idle_share"] for r in use)
        out["idle_from"] = "metrics"
    else:
        step = sum(r["time/step_s"] for r in use)
        engine_idle = max(0.0, 1.0 - sum(r["time/generate_s"] for r in use) / step)
        trainer_idle = max(0.0, 1.0 - sum(r[k] for r in use for k in TRAINER_PHASES) / step)
        out["idle_from"] = "phases"
    out["engine_idle_share"] = engine_idle
    out["trainer_idle_share"] = trainer_idle
    out["idle_share"] = (engine_idle + trainer_idle) / 2  # two processes, one thread each
    return out


def step_s(summary: dict) -> float:
    """The step time the ratio uses: wall clock between rows, ``time/step_s`` for a one-step run."""
    return summary["step_s_wall"] if summary["step_s_wall"] is not None else summary["step_s_metric"]


def result_line(n0: dict, n1: dict, ratio: float, extra: dict) -> str:
    """The final JSON line: step times, their ratio, idle shares and phase times of both runs, ``extra``."""
    s0, s1 = step_s(n0), step_s(n1)
    phases = n0["generate_s"] + n0["trainer_busy_s"]
    result = {
        "step_s_n0": round(s0, 4),
        "step_s_n1": round(s1, 4),
        "ratio_n1_vs_n0": round(ratio, 4),
        # the ratio a perfect overlap of N=0's two phases would give (the rest of the step stays serial)
        "ideal_ratio": round((s0 - phases + max(n0["generate_s"], n0["trainer_busy_s"])) / s0, 4),
        "idle_share_n0": round(n0["idle_share"], 4),
        "idle_share_n1": round(n1["idle_share"], 4),
        "idle_from": n1["idle_from"],
        **{
            f"{k}_n{n}": round(s[k], 4)
            for n, s in ((0, n0), (1, n1))
            for k in ("generate_s", "trainer_busy_s")
        },
        **{f"step_s_metric_n{n}": round(s["step_s_metric"], 4) for n, s in ((0, n0), (1, n1))},
        **extra,
    }
    return json.dumps(result, sort_keys=True)


def load_average() -> float:
    return round(os.getloadavg()[0], 2)


def recipe_overrides(args, hf: Path, data: Path, run_dir: Path, off_policy_steps: int) -> list[str]:
    return [
        f"model.hf_dir={hf}",
        f"data.train_files=[{data}]",
        f"run.dir={run_dir}",
        f"run.seed={args.seed}",
        "run.save_every=0",
        "run.tensorboard=false",
        f"train.steps={args.steps}",
        f"train.micro_batch_size={args.micro_batch_size}",
        f"rollout.prompts_per_step={args.prompts_per_step}",
        f"rollout.group_size={args.group_size}",
        f"rollout.max_new_tokens={args.max_new_tokens}",
        "rollout.engine=sglang",
        "rollout.placement=separate",
        "rollout.engine_nodes=1",
        f"rollout.sglang={{model_path: {hf}, weight_sync: distributed}}",
        f"rollout.off_policy_steps={off_policy_steps}",
    ]


def train_once(
    args, hf: Path, data: Path, work: Path, off_policy_steps: int
) -> tuple[list[dict], list[float]]:
    """One `srpo train` run against a fresh stand-in server process: its metrics rows and their arrival
    times (the file is polled while the trainer runs)."""
    from srpo_megatron.testing.standin_process import StandInProcess

    run_dir = work / f"run_n{off_policy_steps}"
    metrics = run_dir / "metrics.jsonl"
    overrides = recipe_overrides(args, hf, data, run_dir, off_policy_steps)
    argv = [sys.executable, "-m", "srpo_megatron.cli", "train", str(RECIPE)]
    argv += [x for o in overrides for x in ("--override", o)]
    log_path = work / f"train_n{off_policy_steps}.log"
    work.mkdir(parents=True, exist_ok=True)
    with StandInProcess(hf, cpus=args.engine_cpus) as server, open(log_path, "w") as log:
        env = {**os.environ, "SRPO_ENGINE_URLS": server.url, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        pin = (lambda: os.sched_setaffinity(0, args.trainer_cpus)) if args.trainer_cpus else None
        proc = subprocess.Popen(
            argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=pin
        )
        arrivals: list[float] = []
        deadline = time.monotonic() + args.timeout_s
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                if metrics.is_file():
                    seen = metrics.read_text().count("\n")
                    arrivals += [time.monotonic()] * (seen - len(arrivals))
                time.sleep(0.02)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    if proc.returncode != 0:
        tail = log_path.read_text(errors="replace")[-4000:]
        raise SystemExit(
            f"srpo train (off_policy_steps={off_policy_steps}) exited {proc.returncode}:\n{tail}"
        )
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    return rows, arrivals[: len(rows)]


def pair_order(repeat: int) -> tuple[int, int]:
    """Which N runs first in pair ``repeat``: alternating, so that a load drift does not favour one N."""
    return (0, 1) if repeat % 2 == 0 else (1, 0)


def combine(pairs: list[dict[int, dict]]) -> tuple[dict, dict, float]:
    """Repeated (N=0, N=1) pairs as one summary per N (each figure's median over the pairs) and the median
    of the pairs' step-time ratios (each pair ran back to back, under the same load)."""
    merged = []
    for n in (0, 1):
        runs = [p[n] for p in pairs]
        out = {k: statistics.median(r[k] for r in runs) for k, v in runs[0].items() if isinstance(v, float)}
        out["step_s_wall"] = statistics.median(step_s(r) for r in runs)
        out["idle_from"] = runs[0]["idle_from"]
        merged.append(out)
    ratio = statistics.median(step_s(p[1]) / step_s(p[0]) for p in pairs)
    return merged[0], merged[1], ratio


def describe(n: int, s: dict) -> str:
    return (
        f"N={n}: step {step_s(s):.3f} s wall ({s['step_s_metric']:.3f} s time/step_s), generate "
        f"{s['generate_s']:.3f} s, trainer busy {s['trainer_busy_s']:.3f} s (train {s['train_s']:.3f} s), "
        f"idle share of process-seconds {s['idle_share']:.3f} (engine {s['engine_idle_share']:.3f}, "
        f"trainer {s['trainer_idle_share']:.3f}; from {s['idle_from']})"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3, help="(N=0, N=1) pairs, order alternating")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--prompts-per-step", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument(
        "--no-pin", action="store_true", help="do not give the engine and the trainer a core each"
    )
    ap.add_argument("--timeout-s", type=float, default=900.0, help="per training run")
    ap.add_argument("--work-dir", default="", help="keep the runs here (default: a temporary folder)")
    args = ap.parse_args()
    from srpo_megatron.testing.tiny import write_tiny_run

    pin = not args.no_pin and len(os.sched_getaffinity(0)) >= 2
    cpus = sorted(os.sched_getaffinity(0))
    args.engine_cpus, args.trainer_cpus = ({cpus[0]}, {cpus[1]}) if pin else (None, None)
    with tempfile.TemporaryDirectory(prefix="srpo-bench-off-policy-") as tmp:
        work = Path(args.work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        _, hf, data = write_tiny_run(work / "tiny", num_prompts=args.steps * args.prompts_per_step)
        load_before = load_average()
        pairs = []
        for repeat in range(args.repeats):
            pair = {}
            for n in pair_order(repeat):
                rows, arrivals = train_once(args, hf, data, work / f"pair{repeat}", n)
                pair[n] = run_summary(rows, arrivals)
                print(f"pair {repeat} " + describe(n, pair[n]), flush=True)
            print(f"pair {repeat} ratio N=1 / N=0: {step_s(pair[1]) / step_s(pair[0]):.3f}", flush=True)
            pairs.append(pair)
        load = {"load_avg_before": load_before, "load_avg_after": load_average(), "cpus": os.cpu_count()}
        n0, n1, ratio = combine(pairs)
        print(describe(0, n0) + "\n" + describe(1, n1))
        print(
            f"ratio N=1 / N=0: {ratio:.3f} (median of {len(pairs)} pairs); load average "
            f"{load['load_avg_before']} -> {load['load_avg_after']} on {load['cpus']} cores; "
            + ("engine and trainer pinned to a core each" if pin else "not pinned")
        )
        pair_ratios = [round(step_s(p[1]) / step_s(p[0]), 4) for p in pairs]
        extra = {**load, "pinned": pin, "pair_ratios": pair_ratios, "max_new_tokens": args.max_new_tokens}
        print(result_line(n0, n1, ratio, extra), flush=True)


if __name__ == "__main__":
    main()
