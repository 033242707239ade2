"""Where the colocated rollout engines live and which prompts each one serves (pure, no torch.distributed).

``world_size`` trainer ranks are cut into groups of ``size`` consecutive ranks (one node's GPUs with
megatron's rank order); group k hosts engine k on its first rank, which drives the engine over all of the
group's devices (SGLang ``base_gpu_id`` = that rank's local device, ``tp_size`` = the group's devices).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from srpo_megatron.config import ConfigError


@dataclass(frozen=True)
class EngineLayout:
    """Engines over the trainer ranks: engine k = ranks ``[k*size, (k+1)*size)``, hosted on the first."""

    world_size: int
    size: int  # trainer ranks (devices) per engine

    def __post_init__(self) -> None:
        if self.size < 1 or self.world_size % self.size:
            raise ValueError(
                f"rollout.gpus_per_engine={self.size} does not divide the {self.world_size} trainer ranks; "
                "pick a divisor so every engine owns whole devices"
            )

    @property
    def num_engines(self) -> int:
        return self.world_size // self.size

    @property
    def hosts(self) -> list[int]:
        """Global rank hosting each engine."""
        return [k * self.size for k in range(self.num_engines)]

    def engine_of(self, rank: int) -> int:
        return rank // self.size

    def is_host(self, rank: int) -> bool:
        return rank % self.size == 0

    def ranks_of(self, engine: int) -> list[int]:
        return list(range(engine * self.size, (engine + 1) * self.size))


def split_prompts(num_prompts: int, num_engines: int) -> list[range]:
    """Balanced contiguous prompt ranges, one per engine (sizes differ by at most one). A prompt's G
    samples stay together on one engine: siblings share its prefix cache, and routing needs them all."""
    base, extra = divmod(num_prompts, num_engines)
    out, start = [], 0
    for k in range(num_engines):
        n = base + (1 if k < extra else 0)
        out.append(range(start, start + n))
        start += n
    return out


def engine_urls(rollout: Any) -> list[str]:
    """Separate placement: the SGLang servers' base URLs, in engine order. A job started by `srpo launch`
    lists the servers it started in ``SRPO_ENGINE_URLS`` (``launch/engine_nodes.py``) and its engine node
    count in ``SRPO_ENGINE_NODES``; servers started otherwise are given by ``rollout.sglang.url``."""
    job_nodes = os.environ.get("SRPO_ENGINE_NODES")
    if job_nodes is not None and int(job_nodes) != rollout.engine_nodes:
        raise ConfigError(
            f"rollout.engine_nodes={rollout.engine_nodes} but the job was launched with {job_nodes} engine "
            "node(s) (SRPO_ENGINE_NODES); launch again with the recipe's value instead of overriding it"
        )
    listed = os.environ.get("SRPO_ENGINE_URLS") or (rollout.sglang.url if rollout.sglang else "")
    urls = [u.strip() for u in listed.split(",") if u.strip()]
    if not urls:
        raise ConfigError(
            "rollout.placement=separate but no engine servers are known: launch with `srpo launch` (it "
            "starts them on rollout.engine_nodes nodes and sets SRPO_ENGINE_URLS) or give "
            "rollout.sglang.url (comma-separated base URLs of running servers)"
        )
    return urls


def separate_layout(world_size: int, num_engines: int) -> EngineLayout:
    """Separate placement: engine k's client lives on trainer rank ``k * world / num_engines`` (its prompt
    share is generated and gathered there, so no single rank drives every server)."""
    if num_engines > world_size or world_size % num_engines:
        raise ConfigError(
            f"{num_engines} engine servers for {world_size} trainer ranks: the server count must divide the "
            "trainer ranks (one client per server on its own rank); change rollout.engine_nodes or the "
            "engine TP size"
        )
    return EngineLayout(world_size, world_size // num_engines)
