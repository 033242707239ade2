"""gpt-oss's megatron TransformerConfig (models/gpt_oss.py) from the tiny config: the fields each HF feature
maps to, and the fusions that stay off whatever the performance overrides ask."""

from __future__ import annotations

import torch

from srpo_megatron.models.architecture import Architecture
from srpo_megatron.models.gpt_oss import alpha_sigmoid_gate
from srpo_megatron.models.policy import transformer_config_from_hf
from srpo_megatron.testing.tiny import TINY_GPT_OSS_LIMIT, TINY_GPT_OSS_WINDOW, tiny_gpt_oss_config


def test_config_fields_and_fusions_off():
    arch = Architecture.from_hf(tiny_gpt_oss_config(num_layers=4))
    cfg = transformer_config_from_hf(arch, bias_activation_fusion=True, bias_dropout_fusion=True)
    assert cfg.softmax_type == "learnable"
    assert cfg.window_size == (TINY_GPT_OSS_WINDOW - 1, 0)  # HF: W keys ending at the query itself
    assert cfg.window_attn_skip_freq == [1, 0, 1, 0]  # HF layer_types: even layers (0-based) slide
    assert cfg.add_bias_linear and cfg.add_qkv_bias
    assert cfg.activation_func_clamp_value == TINY_GPT_OSS_LIMIT and cfg.glu_linear_offset == 1.0
    assert cfg.moe_router_pre_softmax is False  # top-k on the logits, softmax over the k
    assert not cfg.bias_activation_fusion and not cfg.bias_dropout_fusion
    x = torch.linspace(-3, 3, 7)
    assert torch.equal(cfg.activation_func(x), x * torch.sigmoid(1.702 * x))
    assert torch.equal(alpha_sigmoid_gate(x, 0.5), x * torch.sigmoid(0.5 * x))
