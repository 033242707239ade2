"""DeepSeek-V3 MLA rules on their own (no model run): megatron's YaRN against HF's for every branch of
HF's mscale logic, the refusals, the table's layout against transformers' file names, and SGLang's MLA KV
cache rule."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from srpo_megatron.compat import cpu as compat
from srpo_megatron.conversion.table import ConversionTable
from srpo_megatron.models.architecture import Architecture, UnsupportedModelError
from srpo_megatron.testing.tiny import tiny_deepseek_config


@pytest.fixture
def cpu_compat():
    was_active = compat.cpu_compat_active()
    compat.enable_cpu_compat()
    yield
    if not was_active:
        compat.disable_cpu_compat()


@pytest.mark.parametrize(
    "mscale,mscale_all_dim,factor",
    [(1.0, 0.8, 4.0), (None, 1.0, 4.0), (0.9, 0.0, 4.0), (1.0, 1.0, 40.0), (0.7, 0.5, 1.0), (None, 0.0, 8.0)],
)
def test_megatron_yarn_equals_hf_cos_sin_and_softmax_scale(cpu_compat, mscale, mscale_all_dim, factor):
    """HF's ``attention_scaling`` (cos/sin factor), inverse frequencies and ``yarn_apply_mscale`` softmax
    scale equal megatron's ``YarnRotaryEmbedding`` (built from ``mla_transformer_config``'s fields) and
    MLA's ``mscale(f, mscale_all_dim)**2 / sqrt(q_head_dim)``."""
    from megatron.core.models.common.embeddings import YarnRotaryEmbedding, _yarn_get_mscale
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    from srpo_megatron.models.mla import mla_transformer_config

    hf_config = tiny_deepseek_config(mscale=mscale, mscale_all_dim=mscale_all_dim)
    hf_config.rope_parameters["factor"] = factor
    rope = hf.DeepseekV3RotaryEmbedding(hf_config)
    hf_scale = hf.yarn_apply_mscale(hf_config.rope_parameters, hf_config.qk_head_dim**-0.5)
    arch = Architecture.from_hf(hf_config.to_dict())
    cfg = mla_transformer_config(arch, dict(num_layers=2, hidden_size=64, num_attention_heads=4))
    meg = YarnRotaryEmbedding(
        cfg.qk_pos_emb_head_dim,
        rotary_base=cfg.rotary_base,
        scaling_factor=cfg.rotary_scaling_factor,
        original_max_position_embeddings=cfg.original_max_position_embeddings,
        beta_fast=cfg.beta_fast,
        beta_slow=cfg.beta_slow,
        mscale=cfg.mscale,
        mscale_all_dim=cfg.mscale_all_dim,
    )
    emb, concentration = meg(16)
    positions = torch.arange(16)[None]
    cos, _ = rope(torch.zeros(1), positions)
    assert abs(concentration - rope.attention_scaling) < 1e-12
    assert torch.allclose(emb[:, 0, 0].cos() * concentration, cos[0], atol=1e-6)
    q_head = cfg.qk_head_dim + cfg.qk_pos_emb_head_dim
    meg_scale = _yarn_get_mscale(cfg.rotary_scaling_factor, cfg.mscale_all_dim) ** 2 / math.sqrt(q_head)
    assert abs(meg_scale - hf_scale) < 1e-12


def test_mla_refuses_what_megatron_cannot_reproduce():
    from srpo_megatron.models.mla import mla_transformer_config

    arch = Architecture.from_hf(tiny_deepseek_config().to_dict())
    no_truncate = dataclasses.replace(arch, yarn=dataclasses.replace(arch.yarn, truncate=False))
    with pytest.raises(UnsupportedModelError, match="truncate"):
        mla_transformer_config(no_truncate, {})
    linear = dataclasses.replace(arch, rope_type="linear", yarn=None, rope_factor=2.0)
    with pytest.raises(UnsupportedModelError, match="'linear'"):
        mla_transformer_config(linear, {})


@pytest.mark.parametrize(
    "kw",
    [dict(), dict(q_lora_rank=None), dict(num_layers=3, first_k_dense_replace=1)],
    ids=["q_lora", "q_proj", "moe"],
)
def test_deepseek_table_names_and_shapes_are_transformers_files(tmp_path, kw):
    """The DEEPSEEK_V3 table lists exactly the tensors transformers writes for DeepseekV3ForCausalLM (names
    and shapes), every megatron row of TP-split weights divides at TP2, and an all-dense config is no MoE."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    config = tiny_deepseek_config(**kw)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 - not a mapping
    arch = Architecture.from_hf(tmp_path)
    table = ConversionTable(arch)
    assert set(table.hf_names()) == set(shapes)
    table.check_hf_shapes(shapes)
    for name in table.megatron_names():
        part = table.partition(name)
        if part.dim is not None:
            assert table.full_shape(name, tp=2)[part.dim] % 2 == 0, name
    assert arch.is_moe == ("first_k_dense_replace" in kw)


def sglang_mla_kv_cache_bytes_per_token(arch: Architecture, dtype_bytes: int) -> int:
    """SGLang's MLA rule (sglang/srt/mem_cache/memory_pool.py ``MLATokenToKVPool``: ``kv_cache_dim =
    kv_lora_rank + qk_rope_head_dim``; model_executor/pool_configurator.py: cell size = that dim x layers x
    element size): one latent + RoPE-key row per token per layer, shared by every head and not split over
    attention TP (each rank holds it whole)."""
    return (arch.kv_lora_rank + arch.qk_rope_head_dim) * arch.num_layers * dtype_bytes


def test_sglang_mla_kv_cache_rule_for_deepseek_v3():
    """DeepSeek-V3 (61 layers, kv_lora 512, rope 64): 70,272 bytes per token in bf16, against
    61 x 128 heads x (192 k + 128 v) x 2 = 4,997,120 that a per-head K/V cache would take."""
    cfg = tiny_deepseek_config(num_layers=61).to_dict()
    cfg.update(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
    assert sglang_mla_kv_cache_bytes_per_token(Architecture.from_hf(cfg), 2) == 70_272
