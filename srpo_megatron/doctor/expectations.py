"""What this node should have: from the cluster file, from the Slurm job it runs in, or nothing known.

The doctor is stricter on a GPU node than on a workstation: a missing Transformer Engine is fine for the
CPU test bed and fatal on an H100 node. Inside a job the answer comes from Slurm's environment
(``SLURM_JOB_NUM_NODES``, ``SLURM_GPUS_ON_NODE``); before a launch, from ``--cluster FILE``.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from srpo_megatron.config import ClusterConfig


@dataclass(frozen=True)
class NodeExpectations:
    """What a node must provide for the job (or the planned job) it is checked for."""

    gpus: int | None  # GPUs the node must show (None: unknown, take what torch sees; 0: a CPU node)
    multi_node: bool  # the job spans several nodes: InfiniBand and a shared run.dir are required
    shared_fs: bool  # run.dir must be on a shared filesystem (every node and the login node read it)
    where: str  # this node and what the expectations came from, for the report's header

    @classmethod
    def from_cluster(cls, cluster: ClusterConfig, source: str) -> NodeExpectations:
        # Before launch the node count is not known: a partition that allows several nodes needs both.
        multi = cluster.max_nodes > 1
        return cls(cluster.gpus_per_node, multi, cluster.executor == "slurm" and multi, source)

    @classmethod
    def from_environment(cls, env: dict[str, str] | None = None) -> NodeExpectations:
        env = dict(os.environ) if env is None else env
        host = socket.gethostname()
        job = env.get("SLURM_JOB_ID")
        if not job:
            return cls(None, False, False, host)
        nodes = int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or 1)
        gpus = env.get("SLURM_GPUS_ON_NODE") or env.get("SLURM_GPUS_PER_NODE") or "0"
        count = int(gpus.split(":")[-1]) if gpus.split(":")[-1].isdigit() else 0  # "h100:8" -> 8
        return cls(count, nodes > 1, nodes > 1, f"{host} (Slurm job {job}, {nodes} node(s))")
