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


def test_no_bucket_splits_a_q_a_kv_a_pair():
    """Every bucketizer of the weight sync keeps a layer's q_a_proj and kv_a_proj_with_mqa in one bucket
    (SGLang fuses them only within one load call), at any bucket size; other tensors still split."""
    from srpo_megatron.buckets import PendingParam, TensorSpec, bucketize, bucketize_pending, flat_buckets

    arch = Architecture.from_hf(tiny_deepseek_config(num_layers=3, first_k_dense_replace=1).to_dict())
    table = ConversionTable(arch)
    tensors = [(n, torch.zeros(table.hf_shape(n))) for n in table.hf_names()]

    def pending():
        for n, t in tensors:
            spec = TensorSpec(n, t.dtype, tuple(t.shape))
            yield PendingParam(n, t.numel() * 4, lambda n=n, t=t: [(n, t)], (spec,), None)

    def check(buckets: list[list[str]], limit: int):
        assert len(buckets) > 10
        for names in buckets:
            for q in (n for n in names if n.endswith("self_attn.q_a_proj.weight")):
                assert q.replace("q_a_proj", "kv_a_proj_with_mqa") in names, (limit, names)

    for limit in (1, 700, 2048, 5000):
        check([[n for n, _ in b] for b in bucketize(iter(tensors), limit)], limit)
        check([[n for n, _ in b] for b in bucketize_pending(pending(), limit)], limit)
        check([[s.name for s in b.specs] for b in flat_buckets(pending(), limit)], limit)


def test_default_rope_mla_turns_rope_fusion_off():
    """megatron fuses MLA's RoPE only for YaRN: a GPU run's ``apply_rope_fusion`` must not break a plain-RoPE
    DeepSeek config (MLATransformerConfig would refuse it)."""
    from srpo_megatron.models.mla import mla_transformer_config

    arch = Architecture.from_hf(tiny_deepseek_config().to_dict())
    plain = dataclasses.replace(arch, rope_type="default", yarn=None, rope_factor=None)
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, apply_rope_fusion=True)
    cfg = mla_transformer_config(plain, base)
    assert cfg.rope_type == "rope" and cfg.apply_rope_fusion is False
    assert mla_transformer_config(arch, base).apply_rope_fusion is True


# megatron-core versions whose multi_latent_attention takes HAVE_TE = True without Transformer Engine (its
# TELinear then is a MagicMock and MLASelfAttention raises TypeError): mark_te_absent_for_mla's reason.
MLA_HAVE_TE_WITHOUT_TE = {(0, 16, 1): True, (0, 19, 2): False}


def test_mla_have_te_shim_is_needed_exactly_where_megatron_misreads_te():
    """A fresh process: on a version that needs it the shim flips HAVE_TE once; where megatron reads TE's
    absence itself (0.19.2) it changes nothing. Fails when a pinned version changes its mind."""
    import subprocess
    import sys

    from srpo_megatron.compat.mcore import mcore_version

    version = mcore_version()
    if version not in MLA_HAVE_TE_WITHOUT_TE:
        pytest.skip(f"megatron-core {version} is not pinned in {sorted(MLA_HAVE_TE_WITHOUT_TE)}")
    code = (
        "import megatron.core.transformer.multi_latent_attention as m\n"
        "from srpo_megatron.compat.cpu import mark_te_absent_for_mla\n"
        "print(bool(getattr(m, 'HAVE_TE', False)), mark_te_absent_for_mla(), mark_te_absent_for_mla())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    needed = MLA_HAVE_TE_WITHOUT_TE[version]
    assert out.stdout.split()[-3:] == [str(needed), str(needed), "False"], out.stdout
