"""A stand-in job that follows the trainer's run-directory contract, to check a cluster end to end.

``python -m srpo_megatron.launch.probe --run-dir DIR --steps N`` behaves like ``srpo train`` as seen from
outside, without a model: each step (rank 0 of torchrun) appends ``{"step": s, ...}`` to
``DIR/metrics.jsonl``, then writes the checkpoint ``DIR/checkpoints/step_00000s/`` and points the text
file ``DIR/checkpoints/latest`` at it (the trainer's layout and order); a restarted job (resubmitted, or
requeued by Slurm after preemption) continues after the step ``latest`` names.
``--fail-at-step`` raises, to check failure reporting. Used by the launch tests and by `srpo launch
--probe` to try a new cluster file before spending GPU hours.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import time
from pathlib import Path


def latest_step(run_dir: Path) -> int:
    """The last completed step recorded in ``run_dir/checkpoints/latest`` (0 when starting fresh)."""
    latest = run_dir / "checkpoints" / "latest"
    return int(latest.read_text().strip().rpartition("_")[2]) if latest.is_file() else 0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", required=True, type=Path)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--step-seconds", type=float, default=0.0, help="sleep per step (to cancel mid-run)")
    p.add_argument("--fail-at-step", type=int, default=0, help="raise at this step (0: never)")
    p.add_argument(
        "--require-env",
        action="append",
        default=[],
        metavar="NAME",
        help="fail unless NAME is set in the job; prints a digest of its value, never the value",
    )
    args = p.parse_args(argv)
    for name in args.require_env:  # e.g. a token from the cluster file's env reached the job intact
        if name not in os.environ:
            raise RuntimeError(f"probe: {name} is not set in the job's environment")
        digest = hashlib.sha256(os.environ[name].encode()).hexdigest()[:16]
        print(f"probe: {name} is set (sha256 {digest})", flush=True)

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    start = latest_step(args.run_dir)
    print(f"probe: rank {rank}/{world} on {socket.gethostname()}, resuming after step {start}", flush=True)
    for step in range(start + 1, args.steps + 1):
        time.sleep(args.step_seconds)
        if step == args.fail_at_step:
            raise RuntimeError(f"probe: deliberate failure at step {step}")
        if rank == 0:
            ckpt = args.run_dir / "checkpoints" / f"step_{step:06d}"
            ckpt.mkdir(parents=True, exist_ok=True)
            with open(args.run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps({"step": step, "world_size": world}) + "\n")
            (ckpt / "state.json").write_text(json.dumps({"step": step}))
            # Write-then-rename so a job killed mid-write never leaves a torn `latest`.
            tmp = args.run_dir / "checkpoints" / "latest.tmp"
            tmp.write_text(ckpt.name)
            tmp.replace(args.run_dir / "checkpoints" / "latest")
        print(f"probe: step {step}/{args.steps} done", flush=True)
    print("probe: finished", flush=True)


if __name__ == "__main__":
    main()
