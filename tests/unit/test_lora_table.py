"""The megatron <-> PEFT LoRA name table: both directions round-trip bit for bit (Qwen3, Qwen3-MoE experts,
DeepSeek-V3 MLA with the RoPE row permutation), the contract's names hand-written, MLA's permuted B merges
like the base weight, and every bad name or shape is one line."""

from __future__ import annotations

import pytest
import torch

from srpo_megatron.config.lora import LORA_MLA_TARGETS, LoraConfig
from srpo_megatron.conversion.lora_table import LoraTable, LoraTableError, lora_canonical_name
from srpo_megatron.conversion.table import ConversionTable
from srpo_megatron.models.architecture import Architecture
from srpo_megatron.testing.tiny import tiny_deepseek_config
from tests.helpers.conversion import MOE_CONFIG, arch


def _round_trip(table: LoraTable) -> None:
    g = torch.Generator().manual_seed(0)
    mg = {n: torch.randn(table.row(n).shape, generator=g) for n in table.megatron_names()}
    peft = dict(table.to_peft(n, t) for n, t in mg.items())
    assert sorted(peft) == sorted(table.peft_names())
    back = dict(table.to_megatron(n, t) for n, t in peft.items())
    assert set(back) == set(mg) and all(torch.equal(back[n], mg[n]) for n in mg)
    # and from the PEFT side first
    peft2 = {n: torch.randn(table.peft_row(n).shape, generator=g) for n in table.peft_names()}
    again = dict(table.to_peft(*table.to_megatron(n, t)) for n, t in peft2.items())
    assert all(torch.equal(again[n], peft2[n]) for n in peft2)


def test_qwen3_dense_names_are_the_contracts_and_round_trip():
    a = arch("qwen3", head_dim=4)
    table = LoraTable(a, LoraConfig(rank=3))
    assert table.row("decoder.layers.1.self_attention.linear_qkv.lora.k_proj.lora_B").peft == (
        "base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight"
    )
    hand = {
        "decoder.layers.0.self_attention.linear_qkv.lora.q_proj.lora_A": (
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", (3, 8)),
        "decoder.layers.0.self_attention.linear_proj.lora.o_proj.lora_B": (
            "base_model.model.model.layers.0.self_attn.o_proj.lora_B.weight", (8, 3)),
        "decoder.layers.1.mlp.linear_fc1.lora.up_proj.lora_B": (
            "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight", (6, 3)),
        "decoder.layers.1.mlp.linear_fc2.lora.down_proj.lora_A": (
            "base_model.model.model.layers.1.mlp.down_proj.lora_A.weight", (3, 6)),
    }  # fmt: skip
    for name, (peft, shape) in hand.items():
        assert (table.row(name).peft, table.row(name).shape) == (peft, shape)
    assert len(table.megatron_names()) == 2 * 7 * 2  # layers x projections x factors
    # q: 4 heads x head_dim 4 = 16 outputs, rank 3 -> A [3, 8], B [16, 3]; 7 adapters per layer
    per_layer = (
        (3 * 8 + 16 * 3) + 2 * (3 * 8 + 8 * 3) + (3 * 16 + 8 * 3) + 2 * (3 * 8 + 6 * 3) + (3 * 6 + 8 * 3)
    )
    assert table.numel() == 2 * per_layer
    _round_trip(table)
    _round_trip(LoraTable(a, LoraConfig(rank=2, target_modules=["v_proj", "down_proj"])))


def test_qwen3_moe_expert_names_round_trip_and_follow_ep_offsets():
    a = Architecture.from_hf(MOE_CONFIG)
    table = LoraTable(a, LoraConfig(rank=2, experts=True))
    name = "decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.lora.down_proj.lora_A"
    assert table.row(name).peft == "base_model.model.model.layers.0.mlp.experts.3.down_proj.lora_A.weight"
    assert table.row(name).shape == (2, 32) and table.row(name).expert
    _round_trip(table)
    assert not any(".experts." in n for n in LoraTable(a, LoraConfig(rank=2)).megatron_names())
    # a rank's local names: PP layer offset and EP expert offset
    local = "module.decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.lora.gate_proj.lora_B"
    assert lora_canonical_name(local, layer_offset=1, expert_offset=2) == (
        "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.lora.gate_proj.lora_B"
    )


@pytest.mark.parametrize("interleave", [True, False])
def test_mla_adapters_round_trip_and_b_follows_the_rope_layout(interleave):
    a = Architecture.from_hf(tiny_deepseek_config(rope_interleave=interleave).to_dict())
    lora = LoraConfig(rank=2, alpha=4.0, target_modules=list(LORA_MLA_TARGETS))
    table = LoraTable(a, lora)
    _round_trip(table)
    base = ConversionTable(a)
    g = torch.Generator().manual_seed(1)
    for linear, proj in (("linear_q_up_proj", "q_b_proj"), ("linear_kv_down_proj", "kv_a_proj_with_mqa")):
        stem = f"decoder.layers.0.self_attention.{linear}"
        w = torch.randn(base.full_shape(stem + ".weight"), generator=g)
        an, bn = (f"{stem}.lora.{proj}.lora_{f}" for f in "AB")
        A, B = (torch.randn(table.row(n).shape, generator=g) for n in (an, bn))
        # merging in megatron's layout then converting == converting then merging with the PEFT factors
        ((_, merged_hf),) = base.to_hf(stem + ".weight", w + lora.scaling * B @ A)
        ((_, w_hf),) = base.to_hf(stem + ".weight", w)
        want = w_hf + lora.scaling * table.to_peft(bn, B)[1] @ table.to_peft(an, A)[1]
        torch.testing.assert_close(merged_hf, want)
        assert torch.equal(table.to_peft(an, A)[1], A)  # A: the input side, never permuted
        assert (
            torch.equal(table.to_peft(bn, B)[1], B) == interleave
        )  # B permuted only for rope_interleave=False


def test_bad_names_and_shapes_are_one_line():
    table = LoraTable(arch("qwen3", head_dim=4), LoraConfig(rank=3, target_modules=["q_proj"]))
    cases = [
        lambda: table.row("decoder.layers.0.self_attention.linear_qkv.lora.k_proj.lora_A"),  # not targeted
        lambda: table.row("decoder.layers.9.self_attention.linear_qkv.lora.q_proj.lora_A"),  # no layer 9
        lambda: table.peft_row("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"),
        lambda: table.to_peft(
            "decoder.layers.0.self_attention.linear_qkv.lora.q_proj.lora_A", torch.zeros(8, 3)
        ),
        lambda: LoraTable(arch("qwen3", head_dim=4), LoraConfig(rank=0)),
    ]
    for case in cases:
        with pytest.raises(LoraTableError) as e:
            case()
        assert "\n" not in str(e.value), str(e.value)
    with pytest.raises(LoraTableError, match=r"shape mismatch.*expected \(3, 8\).*got \(8, 3\)"):
        cases[3]()
    oss = dict(MOE_CONFIG, model_type="gpt_oss", num_local_experts=4, experts_per_token=2)
    oss.update(sliding_window=8, layer_types=["sliding_attention", "full_attention"], attention_bias=True)
    with pytest.raises(LoraTableError, match=r"drop 'down_proj' from lora\.target_modules"):
        LoraTable(Architecture.from_hf(oss), LoraConfig(rank=2, target_modules=["down_proj"], experts=True))
