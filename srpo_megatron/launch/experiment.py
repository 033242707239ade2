"""Build and submit a nemo-run Experiment that runs one command under torchrun on a cluster.

`srpo launch RECIPE --cluster cluster/NAME.yaml` turns (cluster definition, recipe, node count) into a
nemo-run ``Experiment`` with one task: ``torchrun -m srpo_megatron.cli train RECIPE --override ...`` on
every node (c10d rendezvous on the first node), run by a ``SlurmExecutor`` (sbatch through a local or SSH
tunnel, pyxis/enroot container flags) or a ``LocalExecutor`` (this workstation). The builder takes any
``python -m`` command (:class:`JobCommand`), so the whole path is exercised with the stand-in job in
:mod:`srpo_megatron.launch.probe` as well as with the trainer.

Preemption: nemo-run always submits with ``sbatch --requeue``, so a preempted job is requeued by Slurm
and restarts the same command; the trainer resumes from the newest complete checkpoint by itself.
``max_retries`` in the cluster file additionally requeues a job whose command exited non-zero.

Rollout placement comes from the recipe loaded as the trainer loads it (``config.load_recipe``:
``rollout.placement``: "colocated" | "separate", ``rollout.engine_nodes``). With "separate" a Slurm job asks
for ``nodes + engine_nodes`` nodes and starts the SGLang servers on the last ``engine_nodes``
(``launch/engine_nodes.py``); the local executor is this one machine and starts no servers: they must
already run, listed in ``SRPO_ENGINE_URLS`` (or ``rollout.sglang.url``). Every process gets
``SRPO_ROLLOUT_PLACEMENT``, ``SRPO_TRAIN_NODES`` and ``SRPO_ENGINE_NODES``.

The torchrun line: on Slurm nemo-run's ``Torchrun`` launcher writes it into the sbatch script, where
bash parses the arguments it shell-quotes. The local executor gets its own line, ``python -m
torch.distributed.run --standalone ...`` (:func:`local_torchrun_args`): nemo-run 0.11's launcher quotes the
arguments the same way there, but torchx's local scheduler hands them to ``Popen`` without a shell, so an
override such as ``data.train_files=[/x]`` would reach the job as ``'data.train_files=[/x]'``, quotes
included.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from srpo_megatron.config import ClusterConfig, ConfigError, RolloutConfig
from srpo_megatron.config.shell_values import check_name
from srpo_megatron.launch.nemo_import import import_nemo_run
from srpo_megatron.launch.shell_safety import REDACTED, check_path, is_secret, secret_setup_lines, shell_word

# The repository root: jobs that run the code in place put it on PYTHONPATH.
REPO_ROOT = Path(__file__).resolve().parents[2]
# Where nemo-run puts the shipped code inside the job ("/nemo_run/code"; outside a container nemo-run
# rewrites /nemo_run to the job directory in the sbatch script).
_SHIPPED_CODE = "/nemo_run/code"


@dataclass(frozen=True)
class RolloutPlacement:
    """Where the rollout engines run: what `srpo launch` needs of the recipe's ``rollout`` section."""

    placement: str = "colocated"  # colocated: engines share the training GPUs; separate: own nodes
    engine_nodes: int = 0  # nodes given to SGLang engines when separate
    engine_tp: int = 1  # the engine's TP size (rollout.sglang.engine_kwargs.tp_size)
    gpus_per_engine: int = 0  # rollout.gpus_per_engine (0 = engine_tp)
    sglang_url: str = ""  # rollout.sglang.url: running servers, comma-separated (separate placement)

    @classmethod
    def from_config(cls, rollout: RolloutConfig) -> RolloutPlacement:
        """The placement of a loaded recipe's ``rollout`` section (its checks ran as it loaded)."""
        sglang = rollout.sglang
        return cls(
            rollout.placement,
            rollout.engine_nodes,
            sglang.tp_size if sglang is not None else 1,
            rollout.gpus_per_engine,
            sglang.url if sglang is not None else "",
        )

    def engine_nodes_on(self, executor: str) -> int:
        """Engine nodes a job on ``executor`` occupies: Slurm starts the SGLang servers on
        ``engine_nodes`` nodes of its own; the local executor is this one machine and starts none (a
        separate placement's servers already run, see :func:`local_engine_urls`)."""
        return 0 if executor == "local" else self.engine_nodes

    def engines(self, train_nodes: int, gpus_per_node: int) -> int:
        """Rollout engines the job runs: one per ``gpus_per_engine`` GPUs of the training nodes
        (colocated) or of the engine nodes (separate)."""
        nodes = self.engine_nodes if self.placement == "separate" else train_nodes
        size = self.gpus_per_engine or self.engine_tp
        total = nodes * max(gpus_per_node, 1)
        if total % size:
            raise ConfigError(
                f"rollout.gpus_per_engine={size} does not divide the {total} GPUs the engines run on; "
                "pick a divisor of the GPU count"
            )
        return total // size

    def describe(self, train_nodes: int, gpus_per_node: int) -> str:
        """One line for the launch output: how many engines, their TP size, on which GPUs."""
        n, size = self.engines(train_nodes, gpus_per_node), self.gpus_per_engine or self.engine_tp
        if self.placement == "separate":
            where = f"on {self.engine_nodes} engine node(s) ({self.engine_nodes * gpus_per_node} GPUs)"
        else:
            where = f"colocated on the {train_nodes * gpus_per_node} training GPUs"
        return f"rollout: {n} engines of TP{self.engine_tp} ({size} GPUs each) {where}"


@dataclass(frozen=True)
class JobCommand:
    """What every torchrun process runs: ``python -m module *args``."""

    module: str  # e.g. "srpo_megatron.cli"
    args: tuple[str, ...] = ()  # e.g. ("train", "examples/x.yaml", "--override", "train.steps=2")


def srpo_train_command(recipe: str, overrides: list[str] | None = None) -> JobCommand:
    """``srpo train RECIPE --override k=v ...`` as a module command (the job's entry point)."""
    args = ["train", recipe]
    for item in overrides or []:
        args += ["--override", item]  # `srpo train` takes one KEY=VALUE per --override
    return JobCommand("srpo_megatron.cli", tuple(args))


@dataclass
class LaunchRequest:
    """One experiment to submit: a command on ``nodes`` training nodes (+ engine nodes)."""

    name: str  # experiment title (nemo-run id = f"{name}_{timestamp}")
    command: JobCommand  # what each process runs
    nodes: int = 1  # training nodes
    placement: RolloutPlacement = field(default_factory=RolloutPlacement)  # from the recipe
    gpus_per_node: int | None = None  # GPUs to ask for per node (None: all the node has)
    env: dict[str, str] = field(default_factory=dict)  # extra job environment
    setup_lines: str = ""  # Slurm: bash run before the command's srun (the per-node `srpo doctor`)

    def job_nodes(self, executor: str) -> int:
        """Nodes the job occupies: the training nodes plus the engine nodes it starts servers on."""
        return self.nodes + self.placement.engine_nodes_on(executor)


ENGINE_URLS_VAR = "SRPO_ENGINE_URLS"


def local_engine_urls(request: LaunchRequest) -> list[str]:
    """Separate placement on the local executor: the running SGLang servers the job will use.

    The local executor starts no engine nodes, so the servers must already run; the job reads them from
    ``SRPO_ENGINE_URLS`` (the request's env, else this process's environment, which the local job
    inherits) or the recipe's ``rollout.sglang.url``. Refuses when none is given, before anything runs.
    """
    listed = request.env.get(ENGINE_URLS_VAR) or os.environ.get(ENGINE_URLS_VAR, "")
    urls = [u.strip() for u in (listed or request.placement.sglang_url).split(",") if u.strip()]
    if not urls:
        raise ConfigError(
            f"rollout.placement 'separate' on the local executor needs running SGLang servers, and "
            f"{ENGINE_URLS_VAR} is unset: the local executor starts no engine nodes (rollout.engine_nodes="
            f"{request.placement.engine_nodes} is not counted); start the servers (python -m "
            f"srpo_megatron.rollout.sglang.servers RECIPE) and export {ENGINE_URLS_VAR}=http://HOST:PORT"
            "[,...] (or set rollout.sglang.url), or use rollout.placement: colocated or a Slurm cluster"
        )
    return urls


def local_torchrun_args(nprocs: int, command: JobCommand) -> list[str]:
    """``python`` arguments of the local job: torchrun on this one machine running ``command``.

    The same single-node settings as nemo-run's launcher (c10d rendezvous on a free localhost port with
    a fresh id: ``--standalone``; every worker's output prefixed with its rank: ``--tee 3``), but passed
    as a plain argument list, so every argument reaches the workers verbatim.
    """
    torchrun = ["--standalone", "--nnodes", "1", "--nproc-per-node", str(nprocs), "--tee", "3"]
    return ["torch.distributed.run", *torchrun, "-m", command.module, *command.args]


def _job_env(cluster: ClusterConfig, request: LaunchRequest, redact: bool = False) -> tuple[dict, dict]:
    """The job's environment as ``(env, secrets)``; secrets are the cluster env's credentials.

    Local jobs get literal values (a process environment). Slurm values are shell words for nemo-run's
    unquoted ``export KEY=VALUE`` lines: the cluster's values are quoted, and only the launcher's own
    ``$PATH`` / ``$PYTHONPATH`` expand in the job. ``redact`` replaces secret values (dry runs).
    """
    local = cluster.executor == "local"
    word = (lambda v: v) if local else shell_word
    env = {
        # megatron-core needs one CUDA work queue so that TP/SP communication overlaps in issue order.
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
        "SRPO_ROLLOUT_PLACEMENT": word(request.placement.placement),
        "SRPO_TRAIN_NODES": str(request.nodes),
        "SRPO_ENGINE_NODES": str(request.placement.engine_nodes),
    }
    gpus = _gpus_per_node(cluster, request)
    if local and request.placement.placement == "separate":
        urls = local_engine_urls(request)
        env[ENGINE_URLS_VAR] = ",".join(urls)
        env["SRPO_ROLLOUT_ENGINES"] = str(len(urls))
    elif gpus > 0:
        env["SRPO_ROLLOUT_ENGINES"] = str(request.placement.engines(request.nodes, gpus))
    code = str(REPO_ROOT) if cluster.code == "in_place" else _SHIPPED_CODE
    inherited = os.environ.get("PYTHONPATH", "") if local else "${PYTHONPATH:-}"
    env["PYTHONPATH"] = word(code) + (os.pathsep + inherited if inherited else "")
    if cluster.venv:
        # nemo-run's job and torchrun are found on PATH, so the environment's bin/ must come first.
        venv_bin = Path(sys.executable).parent if cluster.venv == "auto" else Path(cluster.venv) / "bin"
        env["PATH"] = f"{word(str(venv_bin))}{os.pathsep}{os.environ['PATH'] if local else '$PATH'}"
    secrets = {}
    for key, value in {**cluster.env, **request.env}.items():
        if is_secret(key, cluster.secrets):
            secrets[key] = REDACTED if redact else value
        else:
            env[key] = word(value)
    if local:  # a process environment: nothing is echoed, so secrets join the rest
        env.update(secrets)
        secrets = {}
    return env, secrets


def _gpus_per_node(cluster: ClusterConfig, request: LaunchRequest) -> int:
    return request.gpus_per_node if request.gpus_per_node is not None else cluster.gpus_per_node


def _procs_per_node(cluster: ClusterConfig, request: LaunchRequest) -> int:
    """torchrun workers per node: one per GPU, or the cluster's ``tasks_per_node`` on CPU nodes."""
    gpus = _gpus_per_node(cluster, request)
    return gpus if gpus > 0 else cluster.tasks_per_node


def build_executor(cluster: ClusterConfig, request: LaunchRequest, redact: bool = False):
    """A nemo-run ``SlurmExecutor`` / ``LocalExecutor`` for ``request`` on ``cluster`` (checked first).

    ``redact``: secret values are replaced by ``<redacted>`` (dry runs print the script).
    """
    run = import_nemo_run()

    cluster.check_request(request.job_nodes(cluster.executor), request.gpus_per_node)
    check_name(request.name, "experiment name (--name)")
    env, secrets = _job_env(cluster, request, redact)
    if cluster.executor == "local":
        if request.nodes != 1:
            raise ConfigError(
                f"--nodes {request.nodes}: the local executor runs on this one machine; use --nodes 1 "
                "or a Slurm cluster file"
            )
        # No nemo-run launcher: the task itself is the torchrun line (build_experiment).
        return run.LocalExecutor(ntasks_per_node=_procs_per_node(cluster, request), env_vars=env)
    launcher = run.Torchrun(rdzv_port=cluster.rdzv_port)

    from nemo_run.config import get_nemorun_home

    base = cluster.tunnel.job_dir if cluster.tunnel.kind == "ssh" else get_nemorun_home()
    check_path(base, "experiment directory (nemo-run home or tunnel.job_dir)")
    # Without a container nemo-run rewrites every "/nemo_run" in the sbatch script to the job's
    # directory, so a directory path that itself contains "/nemo_run" would be mangled.
    if not cluster.container_image and "/nemo_run" in base:
        raise ConfigError(
            f"experiment directory {base} contains '/nemo_run', which nemo-run rewrites in scripts "
            "run without a container; use another directory (e.g. .../nemorun or ~/.nemo_run)"
        )
    if cluster.tunnel.kind == "ssh":
        t = cluster.tunnel
        tunnel = run.SSHTunnel(host=t.host, user=t.user, job_dir=t.job_dir, identity=t.identity or None)
    else:
        # nemo-run keeps the experiment files in its own home on a login node; only "" works here.
        tunnel = run.LocalTunnel(job_dir="")
    mounts = list(cluster.container_mounts)
    if cluster.container_image and cluster.code == "in_place" and f"{REPO_ROOT}:{REPO_ROOT}" not in mounts:
        mounts.append(f"{REPO_ROOT}:{REPO_ROOT}")  # the in-place code must be visible in the container
    # nemo-run 0.11 pastes srun arguments into the script unquoted (its `noquote` is `str`): quote them
    # here. Each mount is one quoted word; nemo-run joins them (and its own job-dir mount) with ",".
    image = shell_word(cluster.container_image) if cluster.container_image else None
    mounts = [shell_word(m) for m in mounts]
    executor = run.SlurmExecutor(
        account=cluster.account,
        partition=cluster.partition or None,
        job_name_prefix=f"{cluster.name}-",
        time=cluster.time,
        nodes=request.job_nodes(cluster.executor),
        # nemo-run's torchrun launcher turns this into 1 task x ntasks_per_node workers
        ntasks_per_node=_procs_per_node(cluster, request),
        gpus_per_node=_gpus_per_node(cluster, request) or None,
        cpus_per_task=cluster.cpus_per_task or None,
        mem=cluster.mem or None,
        exclusive=cluster.exclusive or None,
        container_image=image,
        container_mounts=mounts,
        env_vars=env,
        # secrets are exported (untraced) first, so the per-node doctor step already sees them
        setup_lines="\n".join(x for x in (secret_setup_lines(secrets), request.setup_lines) if x) or None,
        tunnel=tunnel,
        # The repository has no submodules: without include_submodules=False nemo-run's submodule pass walks
        # the whole working tree (a .venv included) for archive fragments, about 0.6 s of every launch.
        packager=run.GitArchivePackager(include_submodules=False)
        if cluster.code == "git"
        else run.Packager(),
        launcher=launcher,
        retries=cluster.max_retries,
        poll_estimated_start_time=False,
    )
    if not cluster.account:
        executor.account = None  # no --account flag: the user's default account (CPU/test clusters)
    return executor


def build_experiment(cluster: ClusterConfig, request: LaunchRequest, redact: bool = False):
    """An un-launched nemo-run Experiment holding the single torchrun task; use it as a context manager."""
    run = import_nemo_run()

    executor = build_executor(cluster, request, redact)
    if cluster.executor == "local":  # python -m torch.distributed.run ... -m MODULE ARGS, as a list
        module, *args = local_torchrun_args(executor.nproc_per_node(), request.command)
    else:  # nemo-run's Torchrun launcher wraps `python -m MODULE ARGS` (quoted for the sbatch script)
        module, args = request.command.module, list(request.command.args)
    # LOGLEVEL: torchrun logs every rendezvous detail at INFO, which buries the job's own output.
    task = run.Script(path=module, m=True, args=args, entrypoint="python", env={"LOGLEVEL": "WARNING"})
    exp = run.Experiment(
        request.name,
        executor=executor,
        log_level="WARN",
        enable_goodbye_message=False,
        skip_status_at_exit=True,
    )
    return exp, task


@contextlib.contextmanager
def _private_files():
    old = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(old)


@dataclass
class LaunchResult:
    """What `srpo launch` did: the experiment id (for `srpo jobs`) or, for a dry run, the script."""

    experiment_id: str
    script: str = ""  # dry run on Slurm: the sbatch script that would be submitted


def submit(
    cluster: ClusterConfig, request: LaunchRequest, dryrun: bool = False, redact: bool | None = None
) -> LaunchResult:
    """Submit ``request`` (Slurm: returns once sbatch accepted it; local: returns when it finished).

    With ``dryrun`` nothing runs: the sbatch script nemo-run would submit is returned (Slurm), and the
    experiment directory is removed again. ``redact`` (default: ``dryrun``) hides the cluster's secrets.
    """
    exp, task = build_experiment(cluster, request, redact=dryrun if redact is None else redact)
    # nemo-run's git packager archives the repository around the working directory: make that this one.
    where = contextlib.chdir(REPO_ROOT) if cluster.code == "git" else contextlib.nullcontext()
    # The sbatch script and nemo-run's _CONFIG hold the job's secrets: only the user may read them.
    with where, _private_files(), exp:
        exp.add(task, name=request.name)
        if dryrun:
            exp.dryrun(log=cluster.executor == "local", delete_exp_dir=False)
            exp_dir = Path(exp._exp_dir)  # nemo-run 0.11 has no public accessor (tests fail if it moves)
            scripts = sorted(exp_dir.glob("*_sbatch.sh"))
            script = scripts[0].read_text() if scripts else ""
            shutil.rmtree(exp_dir, ignore_errors=True)
            return LaunchResult(exp._id, script)
        exp.run(detach=True)
        return LaunchResult(exp._id)
