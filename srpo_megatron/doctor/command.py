"""`srpo doctor [RECIPE] [--override KEY=VALUE ...] [--cluster FILE] [--json]`: run every check, print them.

``--acceptance`` runs the image's GPU acceptance checks instead (:mod:`.acceptance`).

Exit status 0 when nothing failed (warnings allowed), 1 when a check failed, so a job step or a script
can gate on it. With ``--cluster`` the node is held to that cluster's expectations (GPUs per node,
multi-node needs); inside a Slurm job they come from the job itself; otherwise this machine is taken as
it is (a CPU machine passes with the GPU extras "not installed (GPU extra)").
"""

from __future__ import annotations

import argparse
import os
import sys

from srpo_megatron.config import ConfigError
from srpo_megatron.doctor import environment, paths
from srpo_megatron.doctor.allreduce import check_allreduce
from srpo_megatron.doctor.expectations import NodeExpectations
from srpo_megatron.doctor.ranges import tested_ranges
from srpo_megatron.doctor.report import Check, exit_code, fail, ok, render_json, render_text


def add_doctor_args(parser: argparse.ArgumentParser) -> None:
    """Arguments of `srpo doctor` (RECIPE, --override, --cluster, --json)."""
    parser.add_argument("recipe", nargs="?", default=None, help="recipe YAML whose paths to check (optional)")
    parser.add_argument(
        "--override", "-o", action="append", default=[], metavar="KEY=VALUE", help="e.g. run.dir=/x"
    )
    parser.add_argument("--cluster", default=None, help="hold this node to a cluster file's expectations")
    parser.add_argument("--json", action="store_true", help="print the checks as JSON")
    parser.add_argument(
        "--acceptance",
        action="store_true",
        help="run the image's GPU acceptance checks (TE attention, fused output layer, live SGLang, "
        "release/resume, a 3-step train); RECIPE: the recipe of the train check (default: the tiny one)",
    )


def recipe_checks(recipe: str, overrides: list[str], expect: NodeExpectations) -> list[Check]:
    """The recipe loads, and the paths it names exist (and the run directory is writable)."""
    from srpo_megatron.config import load_recipe

    try:
        cfg = load_recipe(recipe, overrides)
    except ConfigError as e:
        return [fail("recipe", str(e), "fix the recipe or the override")]
    checks = [ok("recipe", recipe + (f" with {len(overrides)} override(s)" if overrides else ""))]
    checks.append(paths.check_run_dir(cfg.run.dir, expect.shared_fs))
    checks.append(paths.check_hf_dir("model.hf_dir", cfg.model.hf_dir))
    if cfg.model.megatron_checkpoint:
        checks += paths.check_megatron_checkpoint(cfg.model.megatron_checkpoint, cfg.model.hf_dir)
    sglang = cfg.rollout.sglang
    offline = cfg.rollout.engine == "sglang" and sglang is not None and sglang.mode == "offline"
    if offline and sglang.model_path and sglang.model_path != cfg.model.hf_dir:
        checks.append(paths.check_hf_dir("rollout.sglang.model_path", sglang.model_path))
    checks.append(paths.check_data_files([*cfg.data.train_files, *cfg.data.eval_files], cfg.data.data_dir))
    return checks


def collect(recipe: str | None, overrides: list[str], cluster_ref: str | None) -> tuple[list[Check], str]:
    """All checks for this node (and ``recipe``), and the report's header (host and context)."""
    cluster_env: dict[str, str] = {}
    if cluster_ref:
        from srpo_megatron.config import load_cluster

        cluster = load_cluster(cluster_ref)
        cluster_env = dict(cluster.env)
        expect = NodeExpectations.from_cluster(
            cluster, f"{NodeExpectations.from_environment().where} (for cluster {cluster.name})"
        )
    else:
        expect = NodeExpectations.from_environment()
    # A cluster node (or a node checked for one) should use a shared HF cache; a workstation need not.
    on_cluster = bool(cluster_ref) or bool(os.environ.get("SLURM_JOB_ID"))
    ranges = tested_ranges()
    checks = [environment.check_python(ranges), environment.check_torch(ranges)]
    if checks[-1].status == "fail":  # nothing below runs without torch
        return checks, expect.where
    import torch
    import torch.distributed as dist

    gpu_node = bool(expect.gpus) or torch.cuda.is_available()
    checks += [
        environment.check_cuda(gpu_node),
        environment.check_nccl(gpu_node),
        environment.check_gpus(expect.gpus),
        *environment.check_packages(ranges, gpu_node),
        environment.check_infiniband(expect.multi_node, gpu_node),
        paths.check_hf_home(cluster_env, on_cluster),
    ]
    if recipe:
        checks += recipe_checks(recipe, overrides, expect)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    checks.append(check_allreduce(gpus, torch.version.cuda is not None and dist.is_nccl_available()))
    return checks, expect.where


def doctor_main(args: argparse.Namespace) -> int:
    if getattr(args, "acceptance", False):
        from srpo_megatron.doctor.acceptance.command import acceptance_main

        return acceptance_main(args.recipe, args.json, overrides=tuple(args.override))
    try:
        checks, where = collect(args.recipe, list(args.override), args.cluster)
    except ConfigError as e:  # an unusable --cluster file: nothing to hold the node to
        print(f"srpo doctor: error: {e}", file=sys.stderr)
        return 2
    print(render_json(checks, where) if args.json else render_text(checks, where), flush=True)
    return exit_code(checks)
