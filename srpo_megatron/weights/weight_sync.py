"""Weight sync as one strategy object, chosen once from the recipe (after slime's ``weight_updater``).

``RolloutService`` owns the engines and the served version; how the policy reaches them is a
``WeightSync``, picked here from ``rollout.placement`` and ``rollout.sglang.weight_sync`` and nowhere else:

=============  =========================  ==================  ==========================================
placement      rollout.sglang.weight_sync  strategy            how the policy reaches an engine
=============  =========================  ==================  ==========================================
colocated      (engine=hf) / tensor       ``ColocatedSync``   each engine's host receives its replica's
                                                              stream and calls ``engine.update_weights``
                                                              (CPU engine: a copy; SGLang: CUDA IPC)
colocated,     disk                       ``DiskSync``        the same stream, written as a checkpoint
separate                                                      folder per engine, then SGLang's
                                                              ``update_weights_from_disk``
separate       distributed                ``BroadcastSync``   each PP stage's sender broadcasts into every
                                                              server (NCCL group, one per stage)
=============  =========================  ==================  ==========================================

A LoRA policy (``lora.rank > 0``): ``lora.sync: merged`` takes the strategy above, the stream carrying
``W + (alpha/r) B A`` (``weights.export``); ``lora.sync: adapter`` is ``LoraAdapterSync`` (only the adapters,
``weights.lora_engine_sync``), wired for colocated engines: the CPU engine, and SGLang HTTP servers
(``rollout.sglang.mode: http``, ``weight_sync: tensor``); the recipe refuses it elsewhere.

``separate`` + ``tensor`` (CUDA IPC needs the engine on the trainer's GPUs) and ``colocated`` +
``distributed`` (the servers' group needs engines outside the trainer's world) have no strategy: the
recipe refuses them when it loads, and ``strategy_name`` refuses them again here.
"""

from __future__ import annotations

from typing import Any, Protocol

from srpo_megatron.config import ConfigError, RolloutConfig
from srpo_megatron.rollout.base import RolloutEngine
from srpo_megatron.rollout.placement import EngineLayout
from srpo_megatron.rollout.served_precision import served_folder, served_fp8_layout
from srpo_megatron.weights.broadcast_sync import BroadcastSync
from srpo_megatron.weights.disk_sync import DiskSync
from srpo_megatron.weights.engine_sync import ColocatedSync
from srpo_megatron.weights.lora_engine_sync import LoraAdapterSync

# (placement, rollout.sglang.weight_sync) -> strategy; the CPU engine (engine=hf) is colocated, no key.
STRATEGIES = {
    ("colocated", "tensor"): "colocated",
    ("colocated", "disk"): "disk",
    ("separate", "disk"): "disk",
    ("separate", "distributed"): "broadcast",
}


class WeightSync(Protocol):
    """How the trainer's policy reaches the rollout engines. Every method is collective over all trainer
    ranks; ``engine`` is this rank's engine on its host, None elsewhere (it changes after a restart)."""

    def push(self, engine: RolloutEngine | None, version: int, targets: list[int] | None) -> dict[int, str]:
        """Install the policy as ``version`` into the engines (all, or ``targets``). Returns the engines
        whose update failed, with why, the same on every rank (the caller restarts and retries them)."""
        ...

    def engines_restarted(self, engines: list[int]) -> None:
        """``engines`` were rebuilt: forget what they held (a restarted server knows no weights group)."""
        ...

    def close(self) -> None: ...


def strategy_name(rollout: RolloutConfig) -> str:
    """``colocated``, ``disk`` or ``broadcast`` for a recipe's rollout section (module docstring's table)."""
    if rollout.engine == "hf" and rollout.placement == "colocated":
        return "colocated"
    sync = rollout.sglang.weight_sync if rollout.sglang is not None else None
    name = STRATEGIES.get((rollout.placement, sync))
    if name is None:
        valid = ", ".join(f"{p} + {s}" for p, s in STRATEGIES)
        raise ConfigError(
            f"rollout.placement={rollout.placement} with rollout.engine={rollout.engine} and "
            f"rollout.sglang.weight_sync={sync} has no weight sync: CUDA IPC (tensor) needs the engine on "
            "the trainer's GPUs and the broadcast group (distributed) needs separate servers; use one of "
            f"{valid}"
        )
    return name


def lora_adapter_refusal(engine: str, name: str) -> str:
    return (
        f"lora.sync=adapter with rollout.engine={engine} and the {name} weight sync: adapters go only to "
        "colocated engines (the CPU engine, or SGLang with rollout.sglang.weight_sync=tensor); set "
        "lora.sync: merged (the engines get W + (alpha/r) B A as full weights)"
    )


def build_weight_sync(
    cfg: Any, policy: Any, groups: Any, layout: EngineLayout, urls: list[str]
) -> WeightSync:
    """The recipe's strategy (``cfg``: the ``TrainConfig``; ``policy``: its ``model`` and ``table``;
    ``urls``: the separate servers, in engine order). Cheap: groups and folders are made at the first
    ``push``."""
    name = strategy_name(cfg.rollout)
    lora = getattr(cfg, "lora", None)
    if lora is not None and lora.enabled and lora.sync == "adapter":
        if name != "colocated":
            raise ConfigError(lora_adapter_refusal(cfg.rollout.engine, name))
        return LoraAdapterSync(policy, groups, layout, lora, cfg.model.hf_dir)
    if name == "broadcast":
        return BroadcastSync(cfg, policy, groups, layout, urls)
    if name == "disk":
        return DiskSync(cfg, policy, groups, layout)
    if cfg.rollout.engine != "sglang":  # the CPU engine takes bf16, emulates FP8 itself (rollout.precision)
        return ColocatedSync(policy, groups, layout)
    fp8 = served_fp8_layout(served_folder(cfg))  # a blockwise FP8 folder: the sync quantizes (fp8_sync)
    return ColocatedSync(policy, groups, layout, fuse_experts=True, fp8=fp8, tp_payloads=True)
