"""The Qwen3-MoE rows of the conversion table and the Qwen3-MoE architecture parser (no megatron)."""

from __future__ import annotations

import pytest
import torch

from srpo_megatron.conversion.table import ConversionTable, canonical_name, merge_tp_shards, split_tp_shard
from srpo_megatron.models.architecture import Architecture, UnsupportedModelError
from srpo_megatron.testing.tiny import tiny_moe_model
from tests.helpers.conversion import MOE_CONFIG


def test_architecture_reads_moe_fields_and_rejects_dense_layers():
    arch = Architecture.from_hf(MOE_CONFIG)
    assert (arch.num_experts, arch.moe_top_k, arch.moe_intermediate_size, arch.norm_topk_prob) == (
        4,
        2,
        32,
        True,
    )
    assert arch.is_moe and arch.qk_norm
    # transformers 5's to_dict() spells the expert count num_local_experts.
    renamed = {k: v for k, v in MOE_CONFIG.items() if k != "num_experts"} | {"num_local_experts": 4}
    assert Architecture.from_hf(renamed).num_experts == 4
    with pytest.raises(UnsupportedModelError, match="mlp_only_layers"):
        Architecture.from_hf(MOE_CONFIG | {"mlp_only_layers": [0]})
    with pytest.raises(UnsupportedModelError, match="num_experts_per_tok"):
        Architecture.from_hf({k: v for k, v in MOE_CONFIG.items() if k != "num_experts_per_tok"})


def test_expert_rows_use_global_indices_and_file_names():
    table = ConversionTable(Architecture.from_hf(MOE_CONFIG))
    layer1 = "decoder.layers.1.mlp."
    assert table.hf_names_for(layer1 + "router.weight") == ("model.layers.1.mlp.gate.weight",)
    assert table.hf_names_for(layer1 + "experts.local_experts.3.linear_fc1.weight") == (
        "model.layers.1.mlp.experts.3.gate_proj.weight",
        "model.layers.1.mlp.experts.3.up_proj.weight",
    )
    assert table.hf_shape("model.layers.1.mlp.experts.3.down_proj.weight") == (64, 32)
    assert table.hf_shape("model.layers.0.mlp.gate.weight") == (4, 64)
    assert len([n for n in table.hf_names() if ".experts." in n]) == 2 * 4 * 3
    assert not [n for n in table.hf_names() if "mlp.gate_proj" in n]  # no dense MLP rows


def test_rank_names_map_to_global_experts_for_sequential_and_grouped_experts():
    # EP rank 1 of 2 holds experts 2, 3 (local 0, 1); PP stage offset 1.
    seq = canonical_name("module.decoder.layers.0.mlp.experts.local_experts.1.linear_fc2.weight", 1, 2)
    grouped = canonical_name("decoder.layers.0.mlp.experts.linear_fc2.weight1", 1, 2)
    assert seq == grouped == "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2.weight"
    assert canonical_name("decoder.layers.0.mlp.router.weight", 1, 2) == "decoder.layers.1.mlp.router.weight"


def test_expert_round_trip_and_etp_shards():
    table = ConversionTable(Architecture.from_hf(MOE_CONFIG))
    name = "decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight"
    gate, up = torch.randn(32, 64), torch.randn(32, 64)
    hf = dict(zip(table.hf_names_for(name), (gate, up), strict=True))
    full = table.to_megatron(name, hf)
    part = table.partition(name)
    assert part.expert and part.gated
    shards = [split_tp_shard(full, part, 2, r) for r in range(2)]
    assert torch.equal(shards[0][:16], gate[:16]) and torch.equal(shards[0][16:], up[:16])
    back = dict(table.to_hf(name, merge_tp_shards(shards, part)))
    assert all(torch.equal(back[k], v) for k, v in hf.items())


def test_routing_metric_functions():
    import math

    from srpo_megatron.models.moe_metrics import expert_load_imbalance, router_entropy, topk_mismatch_share

    assert expert_load_imbalance(torch.tensor([2.0, 2.0, 2.0, 2.0])) == 1.0
    assert expert_load_imbalance(torch.tensor([8.0, 0.0, 0.0, 0.0])) == 4.0
    assert torch.allclose(
        router_entropy(torch.zeros(3, 4)), torch.full((3,), math.log(4), dtype=torch.float64)
    )
    trainer = torch.tensor([[0, 1], [2, 3], [1, 3]])
    assert (
        topk_mismatch_share(trainer, torch.tensor([[1, 0], [2, 3], [1, 3]])) == 0.0
    )  # order within k ignored
    assert topk_mismatch_share(trainer, torch.tensor([[0, 1], [2, 0], [1, 3]])) == pytest.approx(1 / 3)


def test_routed_experts_from_sglang_payload_and_from_hf_router_logits():
    import base64

    import numpy as np

    from srpo_megatron.rollout.routed_experts import (
        as_token_layer_topk,
        decode_sglang_routed_experts,
        hf_routed_experts,
    )

    ids = np.arange(3 * 2 * 2, dtype=np.int32)
    payload = base64.b64encode(ids.tobytes()).decode()
    flat = decode_sglang_routed_experts(payload)
    assert as_token_layer_topk(flat, 2, 2, tokens=3).tolist() == ids.reshape(3, 2, 2).tolist()
    with pytest.raises(ValueError, match="num_hidden_layers"):
        as_token_layer_topk(flat, 5, 2, tokens=3)
    model = tiny_moe_model(seed=1)
    experts = hf_routed_experts(model, torch.arange(6)[None], top_k=2)
    assert experts.shape == (6, 2, 2)
    # The HF model's own choice: its layer-0 router applied to the layer-0 MLP input.
    captured = {}
    model.model.layers[0].mlp.gate.register_forward_hook(lambda m, i, o: captured.update(idx=o[2]))
    model(torch.arange(6)[None])
    assert torch.equal(captured["idx"].sort(-1).values, experts[:, 0])


def test_routed_experts_with_sglangs_fused_shared_expert_keep_the_routed_columns():
    """SGLang's shared-experts fusion (GLM-4.5, DeepSeek-V3) reports top_k + 1 ids, the shared one last."""
    from srpo_megatron.rollout.routed_experts import as_token_layer_topk

    routed = torch.arange(3 * 2 * 2).reshape(3, 2, 2)
    fused = torch.cat([routed, torch.full((3, 2, 1), 8)], dim=-1)  # the shared expert's id, E = 8
    assert torch.equal(as_token_layer_topk(fused.reshape(-1), 2, 2, tokens=3, fused_shared=1), routed)
    with pytest.raises(ValueError, match="routed expert ids"):
        as_token_layer_topk(fused.reshape(-1), 2, 2, tokens=3)  # a model without shared experts
