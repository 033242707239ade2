"""The `srpo launch` and `srpo jobs` command lines (srpo_megatron/cli.py wires them as subcommands).

    srpo launch RECIPE --cluster cluster/NAME.yaml [--nodes N] [--dryrun] [--wait] [--override k=v ...]
    srpo jobs status|logs|cancel [EXPERIMENT] [--home DIR] [--tail N]

Each ``*_main(args)`` returns a process exit code and prints errors as one clear message (no traceback):
a recipe `srpo train` would refuse (unknown key, bad value, a missing or empty data file: before anything
is submitted, ``--dryrun`` too), an unknown cluster file or field, a request larger than the partition, a
GPU cluster without account or image, and a job that did not complete (its Slurm state and the tail of
its log).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from srpo_megatron.config import (
    CLUSTER_DIR,
    ConfigError,
    TrainConfig,
    cluster_files,
    load_cluster,
    load_recipe,
)
from srpo_megatron.config.shell_values import check_name
from srpo_megatron.launch.experiment import (
    REPO_ROOT,
    JobCommand,
    LaunchRequest,
    RolloutPlacement,
    local_engine_urls,
    srpo_train_command,
    submit,
)
from srpo_megatron.launch.jobs import JobError, check_completed, job_infos, load_experiment, read_logs, wait
from srpo_megatron.launch.shell_safety import name_from_file


def add_launch_args(parser: argparse.ArgumentParser) -> None:
    """Arguments of `srpo launch` (RECIPE, --cluster, --nodes, --gpus-per-node, --dryrun, --wait, ...)."""
    parser.add_argument("recipe", help="training recipe YAML (examples/*.yaml)")
    parser.add_argument(
        "--cluster",
        required=True,
        help=f"cluster definition YAML or a name in {CLUSTER_DIR.name}/ ({', '.join(cluster_files())})",
    )
    parser.add_argument("--nodes", type=int, default=1, help="training nodes (Slurm adds the engine nodes)")
    parser.add_argument("--gpus-per-node", type=int, default=None, help="default: all GPUs of a node")
    parser.add_argument("--dryrun", action="store_true", help="print the sbatch script; submit nothing")
    parser.add_argument("--wait", action="store_true", help="block until the job ends; fail if it fails")
    parser.add_argument("--timeout", type=float, default=24 * 3600.0, help="--wait limit in seconds")
    parser.add_argument("--name", default=None, help="experiment title (default: srpo-<recipe name>)")
    parser.add_argument("--home", default=None, help="nemo-run home for experiment files ($NEMORUN_HOME)")
    parser.add_argument("--force", action="store_true", help="launch even if `srpo plan` says it won't fit")
    parser.add_argument(
        "--skip-doctor",
        action="store_true",
        help="do not run `srpo doctor` on every node as the job's first step",
    )
    parser.add_argument(
        "--probe",
        action="store_true",
        help="run the stand-in job (srpo_megatron.launch.probe) instead of `srpo train`, to try a cluster",
    )
    parser.add_argument(
        "--override", "-o", action="append", default=[], metavar="KEY=VALUE", help="e.g. train.steps=3"
    )


def add_jobs_args(parser: argparse.ArgumentParser) -> None:
    """Arguments of `srpo jobs` (ACTION, EXPERIMENT, --home, --tail)."""
    parser.add_argument("action", choices=["status", "logs", "cancel"])
    parser.add_argument("experiment", nargs="?", default=None, help="id or title (default: latest)")
    parser.add_argument("--home", default=None, help="nemo-run home ($NEMORUN_HOME, default ~/.nemo_run)")
    parser.add_argument("--tail", type=int, default=None, help="logs: only the last N lines")


def _job_command(args: argparse.Namespace, recipe_path: Path, cfg: TrainConfig, code: str) -> JobCommand:
    # The job reads the recipe itself: an absolute path when it runs this checkout in place, a path
    # relative to the repository when the code is shipped with `git archive`.
    if code == "git":
        try:
            recipe_arg = str(recipe_path.resolve().relative_to(REPO_ROOT))
        except ValueError:
            raise ConfigError(
                f"recipe {recipe_path} lies outside the repository, but the cluster ships the code with "
                "git; move the recipe into the repository (e.g. examples/) and commit it"
            ) from None
        tracked = subprocess.run(
            ["git", "-C", str(REPO_ROOT), "cat-file", "-e", f"HEAD:{recipe_arg}"], capture_output=True
        )
        if tracked.returncode != 0:
            raise ConfigError(
                f"recipe {recipe_arg} is not committed, but the cluster ships the code with `git archive "
                "HEAD`, so the job would not find it; commit it (git add + git commit) and launch again"
            )
    else:
        recipe_arg = str(recipe_path.resolve())
    if not args.probe:
        return srpo_train_command(recipe_arg, args.override)
    run_dir, steps = cfg.run.dir, cfg.train.steps  # the probe writes its metrics where the run would
    return JobCommand(
        "srpo_megatron.launch.probe", ("--run-dir", str(Path(run_dir).resolve()), "--steps", str(steps))
    )


def launch_main(args: argparse.Namespace) -> int:
    """`srpo launch`: build the experiment from recipe + cluster and submit it (or print it)."""
    try:
        from srpo_megatron.launch.jobs import set_home

        set_home(args.home)
        cluster = load_cluster(args.cluster)
        recipe_path = Path(args.recipe)
        name = check_name(args.name, "--name") if args.name else f"srpo-{name_from_file(recipe_path.stem)}"
        cfg = load_recipe(recipe_path, list(args.override))  # as `srpo train` will load it
        placement = RolloutPlacement.from_config(cfg.rollout)
        engine_nodes = placement.engine_nodes_on(cluster.executor)
        cluster.check_request(args.nodes, args.gpus_per_node, engine_nodes)
        if not args.probe:  # the trainer's start-up checks that need only the HF config, before submitting
            from srpo_megatron.launch.start_checks import check_before_submit

            gpus = args.gpus_per_node if args.gpus_per_node is not None else cluster.gpus_per_node
            check_before_submit(cfg, args.nodes * (gpus if gpus > 0 else cluster.tasks_per_node))
        request = LaunchRequest(
            name=name,
            command=_job_command(args, recipe_path, cfg, cluster.code),
            nodes=args.nodes,
            placement=placement,
            gpus_per_node=args.gpus_per_node,
        )
        if cluster.executor == "local" and placement.placement == "separate":
            urls = local_engine_urls(request)  # refuses here, before the doctor runs, when none is given
            print(f"# rollout: separate, {len(urls)} running server(s), not started by this job: {urls}")
        if not args.probe:  # the stand-in job reads no data
            from srpo_megatron.launch.data_files import check_data_files

            unseen = check_data_files(cfg.data, cluster)  # train would refuse them after the allocation
            if unseen:
                print(f"# data: {unseen}")
        from srpo_megatron.planner.command import refuse_unless_fits

        refuse_unless_fits(args, cluster)  # memory plan: refuse a recipe that won't fit unless --force
        if not args.skip_doctor:
            from srpo_megatron.doctor.first_step import doctor_first

            recipe_arg = None if args.probe else request.command.args[1]  # the recipe as the job reads it
            ok, doctor_lines = doctor_first(cluster.executor, recipe_arg, list(args.override), args.dryrun)
            if not ok:
                return 1
            request.setup_lines = doctor_lines or request.setup_lines
        gpus = args.gpus_per_node if args.gpus_per_node is not None else cluster.gpus_per_node
        if placement.placement == "separate" and cluster.executor == "slurm" and not args.probe:
            from srpo_megatron.launch.engine_nodes import slurm_engine_lines
            from srpo_megatron.rollout.sglang.servers import engines_per_node, nodes_per_engine

            tp = placement.engine_tp
            span = nodes_per_engine(gpus, tp, placement.engine_nodes)  # refuses engines off whole nodes
            per_node = engines_per_node(gpus, tp) if span == 1 else 1
            recipe, overrides = request.command.args[1], list(args.override)
            lines = slurm_engine_lines(args.nodes, placement.engine_nodes, per_node, recipe, overrides, span)
            request.setup_lines = (request.setup_lines or "") + lines
        result = submit(cluster, request, dryrun=args.dryrun)
        if gpus > 0 and not (cluster.executor == "local" and placement.placement == "separate"):
            print(f"# {placement.describe(args.nodes, gpus)}")
        if args.dryrun:
            print(result.script)
            return 0
        print(f"submitted experiment {result.experiment_id}")
        print(f"  srpo jobs status {result.experiment_id}\n  srpo jobs logs {result.experiment_id}")
        if args.wait:
            exp = load_experiment(result.experiment_id)
            check_completed(exp, wait(exp, timeout=args.timeout))
            print(f"experiment {result.experiment_id} COMPLETED")
        return 0
    except ConfigError as e:  # bad input: one line, exit status 2 (like argparse)
        print(f"srpo launch: error: {e}", file=sys.stderr)
        return 2
    except (JobError, TimeoutError) as e:
        print(f"srpo launch: error: {e}", file=sys.stderr)
        return 1


def jobs_main(args: argparse.Namespace) -> int:
    """`srpo jobs status|logs|cancel [EXPERIMENT]`."""
    from srpo_megatron.launch.jobs import cancel

    try:
        exp = load_experiment(args.experiment, args.home)
        infos = cancel(exp) if args.action == "cancel" else job_infos(exp)
        for info in infos:
            if args.action == "logs":
                sys.stdout.write(read_logs(exp, info, tail=args.tail))
            else:
                slurm_id = info.job_id or "-"
                print(f"{info.experiment_id}  {info.name}  slurm_id={slurm_id}  {info.state}  {info.job_dir}")
        return 0
    except ConfigError as e:
        print(f"srpo jobs: error: {e}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (`python -m srpo_megatron.launch.commands launch|jobs ...`) until cli.py wires it."""
    parser = argparse.ArgumentParser(prog="srpo")
    sub = parser.add_subparsers(dest="command", required=True)
    add_launch_args(sub.add_parser("launch", help="submit a recipe to a cluster through nemo-run"))
    add_jobs_args(sub.add_parser("jobs", help="status, logs or cancel of launched experiments"))
    args = parser.parse_args(argv)
    return launch_main(args) if args.command == "launch" else jobs_main(args)


if __name__ == "__main__":
    sys.exit(main())
