"""``Architecture.from_hf`` for DeepSeek-V3, GLM-4.5 and gpt-oss: the fields the policy, the converter and the
planner read, taken from transformers' own config classes (their defaults are the released models' shapes),
and the configs that cannot be reproduced exactly are refused with the field named."""

from __future__ import annotations

import pytest
from transformers import DeepseekV3Config, Glm4MoeConfig, GptOssConfig

from srpo_megatron.models.architecture import Architecture, UnsupportedModelError

YARN_DS = {
    "rope_type": "yarn",
    "factor": 40.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "rope_theta": 10000.0,
}


def test_deepseek_v3_fields():
    a = Architecture.from_hf(DeepseekV3Config(rope_parameters=YARN_DS))
    assert a.is_mla and a.is_moe
    assert (a.q_lora_rank, a.kv_lora_rank, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim) == (
        1536,
        512,
        128,
        64,
        128,
    )
    assert a.head_dim == 192 and a.num_kv_heads == a.num_heads == 128 and a.rope_interleave
    assert (a.first_dense_layers, a.num_experts, a.moe_top_k, a.shared_expert_intermediate_size) == (
        3,
        256,
        8,
        2048,
    )
    assert (a.router_score, a.router_expert_bias, a.router_groups, a.router_group_topk) == (
        "sigmoid",
        True,
        8,
        4,
    )
    assert a.routed_scaling_factor == 2.5 and a.mtp_layers == 1
    assert not a.is_moe_layer(2) and a.is_moe_layer(3)
    assert a.yarn is not None and a.yarn.attention_factor() == 1.0 and a.yarn.truncate


def test_glm45_air_fields():
    a = Architecture.from_hf(Glm4MoeConfig(attention_bias=True, head_dim=128))
    assert not a.is_mla and a.is_moe and a.qkv_bias and not a.linear_bias
    assert a.rotary_percent == 0.5 and a.head_dim == 128 and a.num_kv_heads == 8
    assert (a.first_dense_layers, a.router_score, a.router_groups) == (1, "sigmoid", 1)
    assert a.shared_expert_intermediate_size == 1408
    assert not Architecture.from_hf(Glm4MoeConfig()).qk_norm
    assert Architecture.from_hf(Glm4MoeConfig(use_qk_norm=True)).qk_norm


def test_gpt_oss_fields():
    a = Architecture.from_hf(GptOssConfig())
    assert a.is_moe and not a.is_mla and a.first_dense_layers == 0
    assert a.attention_sinks and a.linear_bias and a.qkv_bias and a.sliding_window == 128
    assert a.is_sliding_layer(0) and not a.is_sliding_layer(1)
    assert (a.swiglu_limit, a.swiglu_alpha, a.router_score) == (7.0, 1.702, "softmax")
    assert a.yarn is not None and not a.yarn.truncate
    assert a.yarn.attention_factor() == pytest.approx(0.1 * __import__("math").log(32) + 1)
    mx = GptOssConfig().to_dict() | {"quantization_config": {"quant_method": "mxfp4"}}
    assert Architecture.from_hf(mx).mxfp4_experts


def test_irreproducible_configs_are_refused():
    with pytest.raises(UnsupportedModelError, match="num_experts_per_tok == 2 \\* topk_group"):
        Architecture.from_hf(DeepseekV3Config(num_experts_per_tok=6, topk_group=4))
    with pytest.raises(UnsupportedModelError, match="scoring_func='softmax'"):
        Architecture.from_hf(DeepseekV3Config().to_dict() | {"scoring_func": "softmax"})
    with pytest.raises(UnsupportedModelError, match="attention_factor"):
        Architecture.from_hf(DeepseekV3Config(rope_parameters=YARN_DS | {"attention_factor": 1.3}))
    with pytest.raises(UnsupportedModelError, match="quant_method='fp8'"):
        Architecture.from_hf(GptOssConfig().to_dict() | {"quantization_config": {"quant_method": "fp8"}})
    with pytest.raises(UnsupportedModelError, match="'yarn' is not supported for qwen3"):
        Architecture.from_hf(
            {
                "model_type": "qwen3",
                "vocab_size": 8,
                "hidden_size": 8,
                "intermediate_size": 8,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "rope_parameters": {
                    "rope_type": "yarn",
                    "factor": 2.0,
                    "rope_theta": 1e4,
                    "original_max_position_embeddings": 8,
                },
            }
        )
