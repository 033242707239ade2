"""The weight-sync strategy is chosen once, from the recipe's placement and ``rollout.sglang.weight_sync``
(``weights.weight_sync.build_weight_sync``), and the SGLang engine has one route per method whatever the
recipe's ``weight_sync`` says (no string branch left in the engine)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from srpo_megatron.config import ConfigError, RolloutConfig, SGLangEngineConfig
from srpo_megatron.rollout.placement import EngineLayout
from srpo_megatron.weights.broadcast_sync import BroadcastSync
from srpo_megatron.weights.disk_sync import DiskSync
from srpo_megatron.weights.engine_sync import ColocatedSync
from srpo_megatron.weights.weight_sync import build_weight_sync, strategy_name


def _rollout(placement: str, weight_sync: str | None) -> RolloutConfig:
    if weight_sync is None:
        return RolloutConfig(engine="hf", placement=placement)
    sglang = SGLangEngineConfig(model_path="/m", weight_sync=weight_sync, disk_sync_dir="/sync")
    nodes = 1 if placement == "separate" else 0
    return RolloutConfig(engine="sglang", placement=placement, engine_nodes=nodes, sglang=sglang)


def _build(rollout: RolloutConfig):
    cfg = SimpleNamespace(rollout=rollout, model=SimpleNamespace(hf_dir="/m"))
    return build_weight_sync(cfg, policy=None, groups=None, layout=EngineLayout(2, 1), urls=["http://s:1"])


@pytest.mark.parametrize(
    ("placement", "weight_sync", "kind", "name"),
    [
        ("colocated", None, ColocatedSync, "colocated"),  # the CPU engine
        ("colocated", "tensor", ColocatedSync, "colocated"),
        ("colocated", "disk", DiskSync, "disk"),
        ("separate", "disk", DiskSync, "disk"),
        ("separate", "distributed", BroadcastSync, "broadcast"),
    ],
)
def test_each_possible_placement_and_sync_pair_gets_its_strategy(placement, weight_sync, kind, name):
    rollout = _rollout(placement, weight_sync)
    assert strategy_name(rollout) == name
    assert type(_build(rollout)) is kind


@pytest.mark.parametrize(("weight_sync", "fused"), [(None, False), ("tensor", True), ("disk", True)])
def test_sglang_bound_colocated_syncs_send_fused_expert_tensors(weight_sync, fused):
    """SGLang loads gpt-oss's fused expert tensors whole (``weights.fused_experts``); the transformers
    engine takes the table's slices ``x[e]`` (``rollout.hf_moe_layout.gpt_oss_slice_params``)."""
    assert _build(_rollout("colocated", weight_sync)).fuse_experts is fused


@pytest.mark.parametrize(("placement", "weight_sync"), [("separate", "tensor"), ("colocated", "distributed")])
def test_an_impossible_pair_has_no_strategy(placement, weight_sync):
    """Refused when the recipe loads, or at the latest here, naming both keys."""
    with pytest.raises(ConfigError, match=r"rollout\.placement=\w+ .*rollout\.sglang\.weight_sync=\w+"):
        _build(_rollout(placement, weight_sync))


class _Recorder:
    """A transport that answers every SGLang call with success and records the routes."""

    def __init__(self) -> None:
        self.routes: list[str] = []

    def call(self, method, body=None, http_method="POST"):
        self.routes.append(method)
        return {"success": True, "message": ""}

    def health(self) -> bool:
        return True

    def close(self) -> None:
        pass


@pytest.mark.parametrize("weight_sync", ["tensor", "disk", "distributed"])
def test_sglang_update_weights_is_the_tensor_route_whatever_the_recipe_says(weight_sync):
    """The strategy decides the route (disk: ``update_weights_from_disk``; broadcast: ``adopt_version``);
    ``update_weights`` itself has one path. With the old branch on ``cfg.weight_sync`` back, the disk and
    distributed engines would write a folder or ask for a broadcast group instead."""
    from srpo_megatron.rollout.sglang.engine import SGLangEngine

    cfg = SGLangEngineConfig(model_path="/m", weight_sync=weight_sync, disk_sync_dir="/nonexistent")
    transport = _Recorder()
    weights = {"w": torch.ones(4), "b": torch.zeros(2)}
    engine = SGLangEngine(
        cfg,
        transport=transport,
        manifest={n: tuple(t.shape) for n, t in weights.items()},
        serializer=lambda obj: "payload",
    )
    engine.update_weights(weights.items(), version=1)
    assert transport.routes == ["update_weights_from_tensor", "flush_cache"]
    assert engine.weight_version == 1
