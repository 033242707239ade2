"""``lora.sync: adapter`` into colocated engines: each sync moves the policy's LoRA adapters only.

The engine starts from the same HF base the trainer loaded, and the base is frozen, so only the adapters
change: ``LoraAdapterSync`` is ``ColocatedSync``'s feed (``weights.engine_sync.sync_engines``) carrying
``weights.lora_stream``'s PEFT-named adapters, which the host hands to the engine's ``update_lora``:

- the CPU engine (``HFEngine.update_lora``) wraps its model with ``peft`` once and copies the adapters in;
- SGLang (``SGLangEngine.update_lora``, HTTP server launched with ``--enable-lora ...``:
  ``rollout.sglang.servers.with_lora_flags``) loads them as a new adapter ``srpo-policy-v<version>`` by
  ``/load_lora_adapter_from_tensors``, unloads the previous version's, stamps the version
  (``/update_weight_version``) and names the adapter in every ``/generate``'s ``lora_path``, SGLang's own
  multi-LoRA serving (``rollout.sglang.lora_requests``). Its base weights stay resident when it releases
  memory for training (no sync sends them again).

The version moves like a full sync's. Bytes per sync: the adapters' elements x the stream dtype
(``weights.lora_sync.sync_bytes``). Separate SGLang servers and the offline ``sglang.Engine`` take
``lora.sync: merged`` (the recipe refuses ``adapter`` with them).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from srpo_megatron.config.lora import LoraConfig
from srpo_megatron.conversion.lora_export import peft_adapter_config
from srpo_megatron.conversion.lora_table import LoraTable
from srpo_megatron.parallel import ParallelGroups
from srpo_megatron.rollout.base import RolloutEngine
from srpo_megatron.rollout.placement import EngineLayout
from srpo_megatron.weights.engine_sync import ColocatedSync, sync_engines
from srpo_megatron.weights.p2p import WeightSyncError


class _AdapterReceiver:
    """What the feed's host hands the adapter stream to: the engine's ``update_lora``."""

    def __init__(self, engine: RolloutEngine, config: dict) -> None:
        self.engine, self.config = engine, config

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        update = getattr(self.engine, "update_lora", None)
        if update is None:
            raise WeightSyncError(
                f"lora.sync=adapter: the rollout engine {type(self.engine).__name__} takes no adapters; "
                "set lora.sync: merged"
            )
        update(named_tensors, version, self.config)


class LoraAdapterSync(ColocatedSync):
    """``WeightSync`` for a LoRA policy whose colocated engines take adapters (CPU engine, SGLang)."""

    def __init__(
        self, policy: Any, groups: ParallelGroups, layout: EngineLayout, lora: LoraConfig, base_model: str
    ) -> None:
        super().__init__(policy, groups, layout)
        self.lora_table = LoraTable(policy.table.arch, lora, policy.table)
        targets = sorted({r.target for r in self.lora_table._rows.values()})
        self.config = peft_adapter_config(lora, targets, base_model)

    def receiver(self, engine: RolloutEngine) -> Any:
        return _AdapterReceiver(engine, self.config)

    def _sync(self, receiver: Any, version: int, targets: list[int] | None) -> None:
        p = self.policy
        sync_engines(
            p.model, p.table, self.groups, receiver, version, self.layout, targets=targets,
            adapters=self.lora_table,
        )  # fmt: skip
