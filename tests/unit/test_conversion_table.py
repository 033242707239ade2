"""The HF <-> megatron conversion table: hand-worked layouts, exact round trips, and every bad input."""

from __future__ import annotations

import pytest
import torch

from srpo_megatron.conversion.table import (
    GATED_COLUMN,
    ROW,
    ConversionError,
    ConversionTable,
    canonical_name,
    merge_tp_shards,
    split_tp_shard,
)
from srpo_megatron.models.architecture import UnsupportedModelError
from tests.helpers.conversion import arch, random_hf


def test_qkv_fusion_is_grouped_per_query_group_hand_worked():
    # 4 query heads, 2 groups, head_dim 2: megatron rows are [q0 q1 k0 v0 | q2 q3 k1 v1] per group.
    a = arch("qwen2", hidden_size=8)
    t = ConversionTable(a)
    d = a.head_dim
    assert d == 2
    q = torch.arange(8.0).repeat_interleave(1).reshape(8, 1).expand(8, 8).clone()  # head h = rows 2h, 2h+1
    k = 100 + torch.arange(4.0).reshape(4, 1).expand(4, 8).clone()
    v = 200 + torch.arange(4.0).reshape(4, 1).expand(4, 8).clone()
    names = t.hf_names_for("decoder.layers.1.self_attention.linear_qkv.weight")
    full = t.to_megatron(
        "decoder.layers.1.self_attention.linear_qkv.weight", dict(zip(names, (q, k, v), strict=True))
    )
    expected_rows = [0, 1, 2, 3, 100, 101, 200, 201, 4, 5, 6, 7, 102, 103, 202, 203]
    assert full[:, 0].tolist() == expected_rows
    # Qwen2 bias follows the same layout.
    bias_names = t.hf_names_for("decoder.layers.0.self_attention.linear_qkv.bias")
    bias = t.to_megatron(
        "decoder.layers.0.self_attention.linear_qkv.bias",
        dict(zip(bias_names, (q[:, 0], k[:, 0], v[:, 0]), strict=True)),
    )
    assert bias.tolist() == expected_rows


@pytest.mark.parametrize(
    "model_type,extra",
    [
        ("llama", {}),
        ("llama", {"tie_word_embeddings": True, "attention_bias": True}),
        ("qwen2", {}),
        ("qwen3", {"head_dim": 3}),
    ],
)
def test_round_trip_is_bit_exact_for_every_row(model_type, extra):
    t = ConversionTable(arch(model_type, **extra))
    hf = random_hf(t)
    t.check_hf_names(set(hf))
    out = {}
    for name, full in t.iter_to_megatron(hf.__getitem__, tp=2):
        assert tuple(full.shape) == t.full_shape(name, tp=2)
        out.update(t.to_hf(name, full))
    assert sorted(out) == sorted(hf)
    for k in hf:
        assert torch.equal(out[k], hf[k]), k


def test_table_rows_per_architecture():
    assert not any("bias" in n for n in ConversionTable(arch("llama")).hf_names())
    assert any("q_proj.bias" in n for n in ConversionTable(arch("qwen2")).hf_names())
    qwen3 = ConversionTable(arch("qwen3", head_dim=3)).hf_names()
    assert "model.layers.1.self_attn.k_norm.weight" in qwen3
    tied = ConversionTable(arch("llama", tie_word_embeddings=True))
    assert "output_layer.weight" not in tied.megatron_names()
    assert "lm_head.weight" not in tied.hf_names()


def test_vocab_padding_and_its_removal():
    t = ConversionTable(arch("llama"))
    emb = torch.randn(130, 8)
    full = t.to_megatron("embedding.word_embeddings.weight", {"model.embed_tokens.weight": emb}, tp=2)
    assert full.shape == (256, 8)  # multiple of 128 * TP
    assert torch.equal(full[:130], emb) and not full[130:].any()
    assert torch.equal(t.to_hf("embedding.word_embeddings.weight", full)[0][1], emb)


def test_gated_fc1_shards_hold_gate_and_up_halves():
    gate = torch.arange(4.0).reshape(4, 1)
    up = 10 + torch.arange(4.0).reshape(4, 1)
    full = torch.cat([gate, up])
    s0, s1 = (split_tp_shard(full, GATED_COLUMN, 2, r) for r in range(2))
    assert s0[:, 0].tolist() == [0, 1, 10, 11] and s1[:, 0].tolist() == [2, 3, 12, 13]
    assert torch.equal(merge_tp_shards([s0, s1], GATED_COLUMN), full)
    w = torch.randn(3, 4)
    assert torch.equal(merge_tp_shards([split_tp_shard(w, ROW, 2, r) for r in range(2)], ROW), w)


def test_canonical_names():
    assert (
        canonical_name("module.decoder.layers.1.mlp.linear_fc2.weight", 4)
        == "decoder.layers.5.mlp.linear_fc2.weight"
    )
    assert canonical_name("model.decoder.layers.0.self_attention.linear_qkv.layer_norm_weight") == (
        "decoder.layers.0.input_layernorm.weight"
    )
    assert canonical_name("decoder.layers.2.mlp.linear_fc1.layer_norm_weight") == (
        "decoder.layers.2.pre_mlp_layernorm.weight"
    )
    assert canonical_name("embedding.word_embeddings.weight", 3) == "embedding.word_embeddings.weight"


def test_missing_unexpected_and_misshaped_tensors_raise():
    t = ConversionTable(arch("qwen2"))
    hf = random_hf(t)
    names = set(hf) - {"model.layers.0.self_attn.q_proj.bias"} | {"model.layers.0.extra.weight"}
    with pytest.raises(
        ConversionError, match=r"missing tensors \['model.layers.0.self_attn.q_proj.bias'\]"
    ) as e:
        t.check_hf_names(names)
    assert "model.layers.0.extra.weight" in str(e.value)
    bad = dict(hf, **{"model.layers.1.mlp.up_proj.weight": torch.zeros(5, 8)})
    with pytest.raises(
        ConversionError, match=r"model.layers.1.mlp.up_proj.weight: expected \(6, 8\), got \(5, 8\)"
    ):
        list(t.iter_to_megatron(bad.__getitem__))
    with pytest.raises(ConversionError, match=r"linear_fc2\.weight: expected"):
        t.to_hf("decoder.layers.0.mlp.linear_fc2.weight", torch.zeros(8, 5))
    with pytest.raises(ConversionError, match="not in the qwen2 conversion table"):
        t.row("decoder.layers.0.self_attention.q_layernorm.weight")


def test_unsupported_configs_name_the_problem():
    with pytest.raises(UnsupportedModelError, match=r"'mistral' is not supported.*'llama', 'qwen2', 'qwen3'"):
        arch("mistral")
    with pytest.raises(
        UnsupportedModelError, match=r"'yarn' is not supported.*'default', 'linear', 'llama3'"
    ):
        arch("llama", rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4})
    with pytest.raises(UnsupportedModelError, match="'dynamic' is not supported"):  # transformers-4 spelling
        arch("qwen2", rope_parameters=None, rope_theta=1e6, rope_scaling={"type": "dynamic", "factor": 2.0})
    with pytest.raises(UnsupportedModelError, match=r"low_freq_factor=2\.0"):
        arch(
            "llama",
            rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "rope_theta": 1e4},
        )
    with pytest.raises(UnsupportedModelError, match="use_sliding_window"):
        arch("qwen2", use_sliding_window=True)
    with pytest.raises(UnsupportedModelError, match="hidden_act='gelu'"):
        arch("llama", hidden_act="gelu")
    with pytest.raises(UnsupportedModelError, match="mlp_bias"):
        arch("llama", mlp_bias=True)


def test_architecture_reads_both_rope_spellings():
    old = arch("qwen2", rope_parameters=None, rope_theta=1e6, rope_scaling=None)
    assert old.rope_theta == 1e6 and old.rope_type == "default" and old.qkv_bias
    lin = arch("llama", rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5})
    assert (lin.rope_type, lin.rope_factor, lin.rope_theta) == ("linear", 2.0, 5e5)
    q3 = arch("qwen3", head_dim=16)
    assert q3.head_dim == 16 and q3.qk_norm and not q3.qkv_bias
