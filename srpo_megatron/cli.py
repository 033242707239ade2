"""The ``srpo`` command line.

    srpo train RECIPE [--override key=value ...]        SRPO/GRPO/SDPO training (torchrun for TP/PP/DP)
    srpo eval RECIPE --checkpoint DIR [--override ...]  avg@k (+ greedy) of a checkpoint on the held-out data
    srpo plot RUN_DIR [--out DIR]                       PNG plots of a run's metrics
    srpo launch RECIPE --cluster cluster/NAME.yaml ...  submit with nemo-run (Slurm or local)
    srpo jobs status|logs|cancel [EXPERIMENT]           follow launched experiments
    srpo doctor [RECIPE] [--cluster FILE] [--json]      check this node (and a recipe's paths) first
    srpo plan RECIPE --cluster FILE --nodes N [--json]  per-GPU memory; exit 0 fits, 3 does not

Errors in recipes and inputs are printed as one line naming the key/file, value and fix (exit status 2).
"""

from __future__ import annotations

import argparse
import json
import sys

from srpo_megatron.configs import ConfigError
from srpo_megatron.data.rows import DataError
from srpo_megatron.trainer.checkpoint_files import CheckpointError

# torch DCP's .metadata (and megatron's common.pt) are pickles: loading one can run code.
TRUST_NOTE = (
    "Checkpoints must come from a trusted source: torch's distributed-checkpoint .metadata files are "
    "pickles, and loading a crafted one runs code (as torch.load warns)."
)


def _user_error(command: str, error: Exception) -> int:
    """Bad input: one line naming the file/key/value and the fix, exit status 2 (as argparse)."""
    print(f"srpo {command}: error: {' '.join(str(error).split())}", file=sys.stderr)
    return 2


def _add_recipe(p: argparse.ArgumentParser) -> None:
    p.add_argument("recipe", help="YAML recipe (see examples/)")
    p.add_argument(
        "--override", "-o", action="append", default=[], metavar="KEY=VALUE", help="e.g. train.steps=3"
    )


def build_parser() -> argparse.ArgumentParser:
    from srpo_megatron.launch.commands import add_jobs_args, add_launch_args

    parser = argparse.ArgumentParser(prog="srpo", description="SRPO RL post-training on megatron-core")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser(
        "train",
        help="train a policy with SRPO (or a GRPO/SDPO baseline)",
        description="Train; resumes from the newest complete checkpoint of run.dir. " + TRUST_NOTE,
    )
    _add_recipe(p)
    p = sub.add_parser(
        "eval", help="evaluate a checkpoint: avg@k per benchmark and their mean", description=TRUST_NOTE
    )
    _add_recipe(p)
    p.add_argument("--checkpoint", required=True, help="training checkpoint dir, or an HF model folder")
    p.add_argument("--out", default=None, help="output folder (default <run.dir>/eval/manual)")
    p = sub.add_parser("plot", help="render PNG plots from <RUN_DIR>/metrics.jsonl")
    p.add_argument("run_dir")
    p.add_argument("--out", default=None)
    add_launch_args(
        sub.add_parser(
            "launch",
            help="submit a recipe with nemo-run (Slurm or local)",
            description="Submit `srpo train` (the job resumes from run.dir's checkpoints). " + TRUST_NOTE,
        )
    )
    add_jobs_args(sub.add_parser("jobs", help="status, logs or cancel of launched experiments"))
    from srpo_megatron.doctor.command import add_doctor_args
    from srpo_megatron.planner.command import add_plan_args

    add_doctor_args(sub.add_parser("doctor", help="check this node (and a recipe's paths) before a job"))
    add_plan_args(sub.add_parser("plan", help="per-GPU memory of a recipe on a cluster; layouts that fit"))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "train":
            from srpo_megatron.train import main as train_main

            result = train_main(args.recipe, args.override)
            if result["rank"] == 0:
                print(json.dumps(result["summary"], default=str), flush=True)
            return 0
        if args.command == "eval":
            from srpo_megatron.evaluation.command import eval_main

            return eval_main(args)
        if args.command == "plot":
            from srpo_megatron.evaluation.plots import plot_main

            return plot_main(args.run_dir, args.out)
        if args.command == "launch":
            from srpo_megatron.launch.commands import launch_main

            return launch_main(args)
        if args.command == "jobs":
            from srpo_megatron.launch.commands import jobs_main

            return jobs_main(args)
        if args.command == "doctor":
            from srpo_megatron.doctor.command import doctor_main

            return doctor_main(args)
        if args.command == "plan":
            from srpo_megatron.planner.command import plan_main

            return plan_main(args)
    except (ConfigError, DataError, CheckpointError, FileNotFoundError) as e:
        return _user_error(args.command, e)
    return 2


if __name__ == "__main__":
    sys.exit(main())
