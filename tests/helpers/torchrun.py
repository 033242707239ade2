"""Run a command under torchrun exactly as `srpo launch --cluster cluster/local.yaml` would start it.

The command line and the job environment are not written here: ``srpo_megatron.launch.experiment`` builds
the nemo-run ``LocalExecutor`` and the task (``python -m torch.distributed.run ... -m MODULE ARGS``), and
nemo-run's own packaging turns them into the argv its local scheduler runs (``Popen(argv, env=os.environ |
job env)``).
Only ``tasks_per_node`` (the world size each test needs) differs from the shipped cluster/local.yaml.
The process gets its own session, so a hang is killed (its whole process group) at ``timeout`` and
becomes a failure that shows the output, not a stuck CI job.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import tempfile
from dataclasses import dataclass

from srpo_megatron.config import RolloutConfig, from_dict, load_cluster
from srpo_megatron.launch.experiment import JobCommand, LaunchRequest, RolloutPlacement, build_experiment


def srpo_launch_argv(
    command: JobCommand, nprocs: int, recipe: dict | None = None, env: dict[str, str] | None = None
) -> tuple[list[str], dict[str, str]]:
    """``(argv, job env)`` of the torchrun process `srpo launch` starts for ``command`` on cluster/local.yaml
    with ``tasks_per_node: nprocs``; ``recipe`` (a loaded recipe) gives the rollout placement, as there;
    ``env`` is the request's extra job environment (e.g. ``SRPO_ENGINE_URLS`` for a separate placement)."""
    from nemo_run.run.torchx_backend.packaging import package

    rollout = from_dict(RolloutConfig, (recipe or {}).get("rollout") or {}, "rollout")
    placement = RolloutPlacement.from_config(rollout)
    request = LaunchRequest(name="srpo-torchrun-test", command=command, placement=placement, env=env or {})
    cluster = dataclasses.replace(load_cluster("local"), tasks_per_node=nprocs)
    exp, task = build_experiment(cluster, request)
    with tempfile.TemporaryDirectory() as job_dir:
        exp.executor.job_dir = job_dir  # nemo-run writes nothing there for a python -m task
        app = package(request.name, task, exp.executor, serialize_metadata_for_scripts=False)
    (role,) = app.roles
    return [role.entrypoint, *role.args], dict(role.env)


@dataclass
class TorchrunResult:
    argv: list[str]
    returncode: int  # -9 when killed at the timeout
    output: str  # stdout and stderr, interleaved
    timed_out: bool


def run_torchrun(
    command: JobCommand,
    nprocs: int,
    timeout: float,
    env: dict[str, str] | None = None,
    recipe: dict | None = None,
) -> TorchrunResult:
    """Run ``command`` under the generated torchrun line; ``env`` is added to the job environment (as the
    request's env: `srpo launch` builds the job with it)."""
    argv, job_env = srpo_launch_argv(command, nprocs, recipe, env)
    full = {**os.environ, **job_env}
    full["PATH"] = f"{job_env['PATH']}{os.pathsep}{os.environ['PATH']}"  # as torchx's local scheduler
    full.setdefault("PYTHONUNBUFFERED", "x")
    proc = subprocess.Popen(
        argv, env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        return TorchrunResult(argv, proc.returncode, out, False)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun, its workers and their children
        out, _ = proc.communicate()
        return TorchrunResult(argv, proc.returncode, out, True)


def check(result: TorchrunResult) -> str:
    """The output of a run that must succeed; otherwise an assertion error showing how it ended."""
    how = "timed out (killed)" if result.timed_out else f"exited {result.returncode}"
    assert result.returncode == 0 and not result.timed_out, (
        f"{' '.join(result.argv)}\n{how}; last output:\n{result.output[-6000:]}"
    )
    return result.output
