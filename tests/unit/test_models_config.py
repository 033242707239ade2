"""HF config -> megatron TransformerConfig field mapping and the layout checks (no process group needed)."""

from __future__ import annotations

import pytest
import torch

from srpo_megatron.models.architecture import Architecture
from srpo_megatron.models.policy import layer_spec, transformer_config_from_hf

QWEN3 = dict(
    model_type="qwen3", hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=24, vocab_size=300, rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6},
)  # fmt: skip


def test_qwen3_fields_map_onto_transformer_config():
    cfg = transformer_config_from_hf(Architecture.from_hf(QWEN3), tp=2, pp=2)
    assert (cfg.kv_channels, cfg.num_query_groups, cfg.num_attention_heads) == (
        24,
        2,
        4,
    )  # head_dim != H/heads
    assert cfg.qk_layernorm and not cfg.add_qkv_bias and not cfg.add_bias_linear
    assert cfg.normalization == "RMSNorm" and cfg.layernorm_epsilon == 1e-5 and cfg.gated_linear_unit
    assert cfg.activation_func is torch.nn.functional.silu
    assert (cfg.hidden_dropout, cfg.attention_dropout) == (0.0, 0.0)
    assert cfg.use_cpu_initialization == (not torch.cuda.is_available())


def test_qwen2_has_qkv_bias_and_no_qk_norm():
    cfg = transformer_config_from_hf(Architecture.from_hf({**QWEN3, "model_type": "qwen2", "head_dim": None}))
    assert cfg.add_qkv_bias and not cfg.qk_layernorm and cfg.kv_channels == 16


def test_layouts_that_cannot_split_raise():
    arch = Architecture.from_hf(
        {**QWEN3, "num_key_value_heads": 1, "num_attention_heads": 3, "hidden_size": 48}
    )
    with pytest.raises(ValueError, match="must divide num_key_value_heads=1"):
        transformer_config_from_hf(arch, tp=2)
    with pytest.raises(ValueError, match="between 1 and num_hidden_layers=4"):
        transformer_config_from_hf(Architecture.from_hf(QWEN3), pp=5)


def test_uneven_pipeline_stages_take_the_planners_split():
    """PP3 over 4 layers: 1 / 2 / 1 (megatron is given the first and last counts); PP2 divides evenly."""
    from srpo_megatron.models.architecture import pipeline_stage_layers

    config = transformer_config_from_hf(Architecture.from_hf(QWEN3), pp=3)
    assert (config.num_layers_in_first_pipeline_stage, config.num_layers_in_last_pipeline_stage) == (1, 1)
    assert (
        transformer_config_from_hf(Architecture.from_hf(QWEN3), pp=2).num_layers_in_first_pipeline_stage
        is None
    )
    assert pipeline_stage_layers(94, 8) == [11, 12, 12, 12, 12, 12, 12, 11]  # Qwen3-235B-A22B at PP8
    assert pipeline_stage_layers(94, 4) == [23, 24, 24, 23] and pipeline_stage_layers(3, 2) == [1, 2]
    with pytest.raises(ValueError, match="cannot be split"):
        pipeline_stage_layers(5, 4)  # middle stages of 2 leave 1 layer for the first and last


def test_local_spec_uses_sdpa_core_attention_and_qk_norm():
    from srpo_megatron.models.attention import SDPACoreAttention

    spec = layer_spec(Architecture.from_hf(QWEN3), use_te=False)
    attention = spec.submodules.self_attention.submodules
    assert attention.core_attention is SDPACoreAttention
    assert attention.q_layernorm is not None and "Identity" not in str(attention.q_layernorm)
