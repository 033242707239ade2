"""Cluster definitions: where and how `srpo launch` runs a recipe (one YAML file per cluster in cluster/).

A cluster file describes a Slurm partition (or a single workstation) once — account, partition, what a
node has, the container image, the job environment, how to reach the login node — so that recipes stay
free of site details. It loads strictly into :class:`ClusterConfig` (unknown fields are rejected with the
valid ones listed); the checks that need the request (node and GPU counts) live in
:meth:`ClusterConfig.check_request`, so they fail before anything is submitted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from srpo_megatron.config.loading import ConfigError, from_dict, load_yaml
from srpo_megatron.config.shell_values import check_env_keys, check_name, check_no_control_chars

# cluster/ at the repository root: `--cluster h100` is looked up here as cluster/h100.yaml.
CLUSTER_DIR = Path(__file__).resolve().parents[2] / "cluster"


@dataclass
class TunnelConfig:
    """How the launcher reaches `sbatch`: on this machine (login node) or over SSH (a laptop)."""

    kind: Literal["local", "ssh"] = "local"  # local: sbatch runs here; ssh: submit on `host` over SSH
    host: str = ""  # ssh: the cluster's login node
    user: str = ""  # ssh: your user name on the cluster
    job_dir: str = ""  # ssh: experiment directory on the cluster's shared filesystem
    identity: str = ""  # ssh: private key file (empty: ssh-agent / default keys)

    def __post_init__(self) -> None:
        if self.kind == "ssh":
            missing = [k for k in ("host", "user", "job_dir") if not getattr(self, k)]
            if missing:
                raise ConfigError(
                    f"tunnel: kind 'ssh' needs {missing}; set them to the login node, your user name "
                    "and a directory on the cluster's shared filesystem (or kind: local on the login node)"
                )


@dataclass
class ClusterConfig:
    """One Slurm partition (executor: slurm) or this workstation (executor: local)."""

    name: str  # short label; prefixes the Slurm job name
    executor: Literal["slurm", "local"] = "slurm"  # slurm: sbatch through nemo-run; local: run here
    account: str = ""  # Slurm account to charge (required on GPU clusters)
    partition: str = ""  # Slurm partition (empty: the cluster's default partition)
    time: str = "04:00:00"  # wall-clock limit per job, HH:MM:SS (a requeued job gets it afresh)
    max_nodes: int = 1  # nodes a job may use in this partition; larger requests are refused
    gpus_per_node: int = 0  # GPUs each node has (0: CPU nodes)
    gpu_memory_gib: float = 0.0  # memory of one GPU in GiB (H100 80GB: 79.6); `srpo plan` checks against it
    tasks_per_node: int = 1  # torchrun processes per node on CPU nodes (GPU nodes: one per GPU)
    cpus_per_task: int = 0  # --cpus-per-task (0: leave to Slurm)
    mem: str = ""  # --mem per node, e.g. "0" for all of it (empty: partition default)
    exclusive: bool = False  # --exclusive: do not share nodes with other jobs
    container_image: str = ""  # pyxis/enroot image (squashfs path or registry URI); required with GPUs
    container_mounts: list[str] = field(default_factory=list)  # "src:dst" mounts for pyxis
    env: dict[str, str] = field(default_factory=dict)  # job environment (NCCL settings, HF_HOME, ...)
    secrets: list[str] = field(default_factory=list)  # env keys never printed (besides *TOKEN*, *KEY*, ...)
    venv: str = ""  # virtualenv whose bin/ goes first on PATH in the job; "auto": the one launching
    code: Literal["in_place", "git"] = "in_place"  # in_place: run this checkout (shared FS); git: ship HEAD
    max_retries: int = 0  # requeues after a failed run (preemption requeues regardless: sbatch --requeue)
    rdzv_port: int = 29500  # torchrun c10d rendezvous port on the first node
    tunnel: TunnelConfig = field(default_factory=TunnelConfig)  # how to reach sbatch

    def __post_init__(self) -> None:
        # Everything here ends up in a shell script: refuse what would break or escape it at load.
        check_no_control_chars(self)
        check_name(self.name, "cluster name")
        check_env_keys(self.env)
        unknown = sorted(set(self.secrets) - set(self.env))
        if unknown:
            raise ConfigError(f"secrets: {unknown} are not keys of env; list env keys that hold credentials")
        if self.max_nodes < 1:
            raise ConfigError(f"max_nodes: {self.max_nodes} must be >= 1 (nodes in the partition)")
        if self.gpus_per_node < 0 or self.tasks_per_node < 1:
            raise ConfigError(
                f"gpus_per_node={self.gpus_per_node}, tasks_per_node={self.tasks_per_node}: "
                "need gpus_per_node >= 0 and tasks_per_node >= 1"
            )
        if self.executor == "slurm" and self.gpus_per_node > 0:
            # A GPU job without an account is rejected by every accounting-enforcing site, and without an
            # image the job would run on the bare node OS without CUDA/NCCL/megatron: fail here instead.
            hints = {
                "account": "account: <your Slurm account>",
                "container_image": "container_image: <an NGC PyTorch image with srpo_megatron installed>",
            }
            missing = [k for k in hints if not getattr(self, k)]
            if missing:
                raise ConfigError(
                    f"cluster {self.name!r} has GPUs but no {' and no '.join(missing)}; set "
                    f"{' and '.join(hints[k] for k in missing)} in the cluster file"
                )
        if self.tunnel.kind == "ssh" and self.code != "git":
            raise ConfigError(
                "tunnel kind 'ssh' submits from another machine, so this checkout is not on the cluster; "
                "set code: git (ship the committed code with each experiment)"
            )
        if self.executor == "local" and self.tunnel.kind != "local":
            raise ConfigError("executor 'local' runs on this machine; remove the ssh tunnel section")

    @property
    def procs_per_node(self) -> int:
        """torchrun processes per node: one per GPU, or ``tasks_per_node`` on CPU nodes."""
        return self.gpus_per_node if self.gpus_per_node > 0 else self.tasks_per_node

    def check_request(self, nodes: int, gpus_per_node: int | None = None, engine_nodes: int = 0) -> None:
        """Refuse a request the partition cannot hold, before submitting (Slurm would pend or reject):
        ``nodes`` training nodes (``--nodes``) plus ``engine_nodes``. ``srpo launch`` and ``srpo plan``
        both ask this, so a plan never fits what launch refuses."""
        if nodes < 1:
            raise ConfigError(
                f"--nodes {nodes}: a job needs at least one training node; pass --nodes 1 or more"
            )
        nodes += engine_nodes
        if nodes > self.max_nodes:
            raise ConfigError(
                f"the request needs {nodes} nodes but partition {self.partition or '(default)'} of cluster "
                f"{self.name!r} allows at most {self.max_nodes} (max_nodes); use --nodes <= {self.max_nodes} "
                "(on Slurm with rollout.placement 'separate', rollout.engine_nodes count too)"
            )
        if gpus_per_node is not None and gpus_per_node > self.gpus_per_node:
            raise ConfigError(
                f"the request needs {gpus_per_node} GPUs per node but nodes of cluster {self.name!r} have "
                f"{self.gpus_per_node}; lower the GPUs per node or pick a cluster with larger nodes"
            )


def cluster_files(directory: Path = CLUSTER_DIR) -> list[str]:
    """The cluster definitions shipped in ``directory`` (for error messages and `--help`)."""
    return sorted(str(p.relative_to(directory.parent)) for p in directory.glob("*.yaml"))


def load_cluster(path_or_name: str | Path) -> ClusterConfig:
    """Load ``cluster/NAME.yaml`` (a path, or a bare name looked up in cluster/) into a ClusterConfig."""
    path = Path(path_or_name)
    if not path.is_file() and not path.suffix and (CLUSTER_DIR / f"{path}.yaml").is_file():
        path = CLUSTER_DIR / f"{path}.yaml"
    if not path.is_file() and not path.is_absolute() and (CLUSTER_DIR.parent / path).is_file():
        path = CLUSTER_DIR.parent / path  # "cluster/ci.yaml" from outside the checkout
    if not path.is_file():
        raise ConfigError(
            f"cluster file {str(path_or_name)!r} does not exist; valid ones: {cluster_files()} "
            "(or write your own from cluster/h100.yaml)"
        )
    data = load_yaml(path, "cluster file", "cluster/h100.yaml")
    try:
        return from_dict(ClusterConfig, data)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
