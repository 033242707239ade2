"""The ``srpo`` command line.

    srpo train RECIPE [--override key=value ...]        SRPO/GRPO/SDPO training (torchrun for TP/PP/DP)
    srpo eval RECIPE --checkpoint DIR [--override ...]  avg@k (+ greedy) of a checkpoint on the held-out data
    srpo plot RUN_DIR [--out DIR]                       PNG plots of a run's metrics
    srpo launch RECIPE --cluster cluster/NAME.yaml ...  submit with nemo-run (Slurm or local)
    srpo jobs status|logs|cancel [EXPERIMENT]           follow launched experiments
    srpo doctor [RECIPE] [--cluster FILE] [--json]      check this node (and a recipe's paths) first
    srpo doctor --acceptance [RECIPE] [--json]          does the image's GPU stack work here (<= 10 min)
    srpo plan RECIPE --cluster FILE --nodes N [--json]  per-GPU memory; exit 0 fits, 3 does not

Errors in recipes and inputs are printed as one line naming the key/file, value and fix (exit status 2).
"""

from __future__ import annotations

import argparse
import json
import sys

from srpo_megatron.config import ConfigError

# torch DCP's .metadata (and megatron's common.pt) are pickles: loading one can run code.
TRUST_NOTE = (
    "Checkpoints must come from a trusted source: torch's distributed-checkpoint .metadata files are "
    "pickles, and loading a crafted one runs code (as torch.load warns): resume, export and evaluate only "
    "run directories you wrote or got from someone you trust."
)

# rollout.reward_fns names any importable function; the trainer imports its module and calls it.
REWARD_NOTE = (
    "A recipe's reward targets (rollout.reward_fns, 'package.module:function') are code that runs: their "
    "modules are imported and called on every response, so only run recipes and reward modules you trust."
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


def _add_train(p: argparse.ArgumentParser) -> None:
    _add_recipe(p)


def _add_eval(p: argparse.ArgumentParser) -> None:
    _add_recipe(p)
    p.add_argument(
        "--checkpoint",
        required=True,
        help="run directory (its newest checkpoint that verifies), training checkpoint, converter output or "
        "HF model folder",
    )
    p.add_argument("--out", default=None, help="output folder (default <run.dir>/eval/manual)")


def _add_plot(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir")
    p.add_argument("--out", default=None)


def _add_launch(p: argparse.ArgumentParser) -> None:
    from srpo_megatron.launch.commands import add_launch_args

    add_launch_args(p)


def _add_jobs(p: argparse.ArgumentParser) -> None:
    from srpo_megatron.launch.commands import add_jobs_args

    add_jobs_args(p)


def _add_doctor(p: argparse.ArgumentParser) -> None:
    from srpo_megatron.doctor.command import add_doctor_args

    add_doctor_args(p)


def _add_plan(p: argparse.ArgumentParser) -> None:
    from srpo_megatron.planner.command import add_plan_args

    add_plan_args(p)


# name -> (help, description, adds its arguments). A subcommand's module is imported only when that
# subcommand runs (or its arguments are needed), so `srpo plan` never imports the trainer or torch.
COMMANDS = {
    "train": (
        "train a policy with SRPO (or a GRPO/SDPO baseline)",
        "Train; resumes from the newest complete checkpoint of run.dir. " + TRUST_NOTE + " " + REWARD_NOTE,
        _add_train,
    ),
    "eval": (
        "evaluate a checkpoint: avg@k per benchmark and their mean",
        TRUST_NOTE + " " + REWARD_NOTE,
        _add_eval,
    ),
    "plot": ("render PNG plots from <RUN_DIR>/metrics.jsonl", None, _add_plot),
    "launch": (
        "submit a recipe with nemo-run (Slurm or local)",
        "Submit `srpo train` (the job resumes from run.dir's checkpoints). " + TRUST_NOTE + " " + REWARD_NOTE,
        _add_launch,
    ),
    "jobs": ("status, logs or cancel of launched experiments", None, _add_jobs),
    "doctor": ("check this node (and a recipe's paths) before a job", None, _add_doctor),
    "plan": ("per-GPU memory of a recipe on a cluster; layouts that fit", None, _add_plan),
}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; given ``argv``, only the chosen subcommand's arguments (and module) are loaded."""
    first = next((a for a in argv if not a.startswith("-")), None) if argv is not None else None
    chosen = first if first in COMMANDS else None
    parser = argparse.ArgumentParser(prog="srpo", description="SRPO RL post-training on megatron-core")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, description, add_args) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=description)
        if chosen is None or name == chosen:
            add_args(p)
    return parser


def _user_errors() -> tuple[type[Exception], ...]:
    """The exceptions that mean bad input (one line, exit status 2), imported only when one is raised."""
    from srpo_megatron.conversion.checkpoint_files import CheckpointError
    from srpo_megatron.data.rows import DataError

    return (ConfigError, DataError, CheckpointError, FileNotFoundError)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    try:
        if args.command == "train":
            from srpo_megatron.config import load_recipe

            cfg = load_recipe(args.recipe, args.override)  # a bad recipe fails here, before torch loads
            from srpo_megatron.trainer.run.run_dir import check_run_dir_early, release_run_dir

            check_run_dir_early(cfg.run.dir)  # a file, read-only, in use by another trainer: before torch
            from srpo_megatron.compat.fallbacks import hide_fallback_warnings

            hide_fallback_warnings()  # megatron's expected TE/Apex fallbacks, before train imports megatron
            from srpo_megatron.models.performance import check_transformer_engine

            check_transformer_engine(cfg.performance)  # a broken TE: one line, before megatron imports it
            from srpo_megatron.train import train

            try:
                result = train(cfg)
            finally:
                release_run_dir(cfg.run.dir)  # this process is done with it, whatever the outcome
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
    except Exception as e:
        if isinstance(e, _user_errors()):
            return _user_error(args.command, e)
        raise
    return 2


if __name__ == "__main__":
    sys.exit(main())
