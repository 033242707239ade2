"""The FP8 blockwise weight sync against SGLang's own code (marker ``sglang_real``; both wheels).

What is real here: SGLang's ``Fp8Config`` (from the hub's ``quantization_config``), its parallel linear
layers (``QKVParallelLinear``, ``MergedColumnParallelLinear``, ``RowParallelLinear``,
``ColumnParallelLinear``) whose ``Fp8LinearMethod.create_weights`` makes the ``weight`` (e4m3) and
``weight_scale_inv`` (``BlockQuantScaleParameter``) parameters and whose weight loaders place each shard
and each scale block, ``Qwen3ForCausalLM.load_weights`` (name routing, q/k/v and gate/up stacking), its
checkpoint reader ``safetensors_weights_iterator``, its dequantization ``fp8_utils.block_quant_dequant``
and DeepSeek's ``post_load_weights`` (``w_kc``/``w_vc`` from ``kv_b_proj`` and its ``weight_scale_inv``).

Stand-ins (SGLang's models need CUDA to be built): the model object ``self`` is an ``nn.Module`` holding
those real layers under SGLang's parameter names, and SGLang's TP group is replaced by its own test hook
``get_parallel().override(tp_size=1, tp_rank=0, ...)`` (``sglang/srt/runtime_context.py``).

FP8 rounding bound (checked element-wise): a block is scaled by ``s = 448 / amax`` so every scaled value
lies in [-448, 448]. e4m3 keeps 3 mantissa bits: round-to-nearest of a normal value ``v`` (|v| >= 2^-6) errs
by at most half a unit in the last place, ``|v| * 2^-4``; below 2^-6 the spacing is the subnormal step
2^-9, error <= 2^-10. Dividing by ``s``: ``|dequant(w) - w| <= 2^-4 |w| + (amax / 448) * 2^-10``
(the fp32 product ``q * scale_inv`` adds at most one fp32 rounding, 2^-24 relative, absorbed by the
``2^-4`` term's slack in the test's 1e-6 relative margin).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from srpo_megatron.conversion.fp8_layout import Fp8Layout
from srpo_megatron.rollout.base import EngineError
from srpo_megatron.rollout.gate import missing_names, validated_stream
from srpo_megatron.rollout.served_precision import with_fp8_scales
from srpo_megatron.testing import sglang_import
from srpo_megatron.weights import fp8_sync

pytestmark = pytest.mark.sglang_real

REAL = sglang_import.load()
if REAL is None:
    pytest.skip(
        "no sglang wheel on the path (tools/dev test runs this tier with one)", allow_module_level=True
    )

from sglang.srt.layers.quantization.fp8_utils import block_quant_dequant  # noqa: E402
from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator  # noqa: E402

from tests.helpers.sglang_fp8 import (  # noqa: E402
    bf16_weights,
    blockwise_amax,
    checkpoint_folder,
    fp8_config,
    load,
    params,
    qwen3_standin,
    reference_quantize,
    same,
    sync_stream,
    tp1,
    within_fp8_rounding,
)


def test_fp8_sync_loads_what_sglang_loads_from_an_fp8_folder(tmp_path):
    """The sync's buckets through SGLang's Qwen3 loader = the same weights' FP8 checkpoint folder through
    SGLang's safetensors reader and the same loader: every parameter bit for bit (weights and scales,
    q/k/v and gate/up shards stacked by SGLang, partial edge blocks)."""
    weights = bf16_weights()
    buckets = sync_stream(weights)
    assert len(buckets) > 1  # several load_weights calls, as several update requests
    with tp1():
        synced, from_disk = qwen3_standin(), qwen3_standin()
    load(synced, buckets)
    load(from_disk, [list(safetensors_weights_iterator(checkpoint_folder(tmp_path, weights)))])
    got, want = params(synced), params(from_disk)
    assert set(got) == set(want) and len(got) == 16
    assert same(got, want) == []
    # every scale was written (SGLang initialises them to float32's minimum)
    assert all(bool((t > 0).all()) for n, t in got.items() if n.endswith("weight_scale_inv"))


def test_sglang_dequant_of_the_sync_is_within_fp8_rounding():
    weights = bf16_weights(seed=1)
    with tp1():
        stand = qwen3_standin()
    load(stand, sync_stream(weights))
    assert within_fp8_rounding(stand, weights) == []
    layer = stand.model.layers[0].mlp.down_proj  # and FP8 changed something (the test can see a gap)
    deq = block_quant_dequant(layer.weight.data, layer.weight_scale_inv.data, [128, 128], torch.float32)
    assert float((deq - weights["model.layers.0.mlp.down_proj.weight"].float()).abs().max()) > 0


def test_bf16_under_dense_names_into_an_fp8_engine_is_caught():
    """Planted: today's sync (bf16 tensors, no scales) into an FP8 engine. SGLang's loader takes it without
    a word (copy_ casts bf16 to e4m3 unscaled; the scales keep their init value); our gate refuses it for
    the missing scales, and the dequantized weights are not the policy's."""
    weights = bf16_weights(seed=2)
    with tp1():
        stand = qwen3_standin()
    load(stand, [list(weights.items())])  # no error from SGLang
    assert within_fp8_rounding(stand, weights) != []
    manifest = with_fp8_scales({n: tuple(t.shape) for n, t in weights.items()}, Fp8Layout())
    missing = missing_names(manifest, set(weights))
    assert len(missing) == len(weights) and all(m.endswith("weight_scale_inv") for m in missing)
    with pytest.raises(EngineError, match="mis-typed tensor"):  # refused at the first tensor, before sending
        list(validated_stream(weights.items(), manifest, set()))


@pytest.mark.parametrize("bug", ["scale instead of scale_inv", "transposed scale"])
def test_a_wrong_scale_convention_is_caught(monkeypatch, bug):
    """Planted: the sync's quantizer sends 448/amax (the factor, not its inverse) or a transposed grid.
    SGLang loads either where the shape fits (down_proj's 3 x 3 grid) and dequantizes garbage."""
    real = fp8_sync.quantize

    def planted(w, block):
        q, s = real(w, block)
        return q, (1.0 / s if bug == "scale instead of scale_inv" else s.t().contiguous())

    monkeypatch.setattr(fp8_sync, "quantize", planted)
    weights = {n: w for n, w in bf16_weights(seed=3).items() if "down_proj" in n}
    with tp1():
        stand = qwen3_standin()
    load(stand, sync_stream(weights))
    got = block_quant_dequant(
        stand.model.layers[0].mlp.down_proj.weight.data,
        stand.model.layers[0].mlp.down_proj.weight_scale_inv.data,
        [128, 128],
        torch.float32,
    )
    want = weights["model.layers.0.mlp.down_proj.weight"].float()
    bound = 2.0**-4 * want.abs() + blockwise_amax(want) / 448.0 * 2.0**-10
    assert not bool(((got - want).abs() <= bound).all())
    monkeypatch.setattr(fp8_sync, "quantize", real)  # and the real one passes the same check
    load(stand, sync_stream(weights))
    got = block_quant_dequant(
        stand.model.layers[0].mlp.down_proj.weight.data,
        stand.model.layers[0].mlp.down_proj.weight_scale_inv.data,
        [128, 128],
        torch.float32,
    )
    assert bool(((got - want).abs() <= bound * (1 + 1e-6)).all())


def mla_standin(kv_lora: int = 192, heads: int = 4, nope: int = 64, v: int = 64) -> torch.nn.Module:
    """``self`` for DeepSeek's ``post_load_weights``: one layer whose ``kv_b_proj`` is SGLang's real FP8
    ``ColumnParallelLinear`` (kv_lora_rank 192: a partial 64-column edge block)."""
    from sglang.srt.layers.linear import ColumnParallelLinear

    with tp1():
        kv_b = ColumnParallelLinear(
            kv_lora,
            heads * (nope + v),
            bias=False,
            quant_config=fp8_config(),
            params_dtype=torch.bfloat16,
            prefix="model.layers.0.self_attn.kv_b_proj",
        )
    attn = torch.nn.Module()
    attn.kv_b_proj, attn.qk_nope_head_dim, attn.v_head_dim = kv_b, nope, v
    attn.w_kc = attn.w_vc = attn.w_scale = None
    layer = torch.nn.Module()
    layer.self_attn = attn
    stand = torch.nn.Module()
    stand.model = torch.nn.Module()
    stand.model.layers = torch.nn.ModuleList([layer])
    stand.model.start_layer, stand.model.end_layer = 0, 1
    stand.config = SimpleNamespace(num_hidden_layers=1, architectures=["DeepseekV3ForCausalLM"])
    stand.quant_config = fp8_config()
    return stand


def mla_load(stand: torch.nn.Module, named) -> SimpleNamespace:
    """Each tensor through its real parameter's weight_loader (deepseek_v2's load_weights routes
    ``kv_b_proj.weight`` / ``.weight_scale_inv`` to them by name), then SGLang's ``post_load_weights``."""
    from sglang.srt.models.deepseek_v2 import DeepseekV3ForCausalLM

    by_name = dict(stand.named_parameters())
    with tp1():
        for n, t in named:
            by_name[n].weight_loader(by_name[n], t)
        DeepseekV3ForCausalLM.post_load_weights(stand, weight_names=[n for n, _ in named])
    attn = stand.model.layers[0].self_attn
    return SimpleNamespace(w_kc=attn.w_kc, w_vc=attn.w_vc, w_scale=attn.w_scale)


def test_mla_post_load_weights_reads_the_sent_scale_like_the_folders():
    """DeepSeek MLA: ``post_load_weights`` re-derives ``w_kc``/``w_vc`` from ``kv_b_proj`` dequantized with
    its ``weight_scale_inv`` (on CPU it requantizes per tensor: ``block_quant_to_tensor_quant``; on CUDA
    with 128 blocks ``block_quant_dequant``). From the sync's tensors it gets exactly what it gets from the
    FP8 folder's (reference quantizer); planted: a stale scale (the hub's, here ones) does not."""
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    w = (torch.randn(4 * 128, 192, generator=torch.Generator().manual_seed(4)) * 0.05).bfloat16()
    synced = mla_load(mla_standin(), list(fp8_sync.quantize_named([(name, w)], Fp8Layout())))
    q, s = reference_quantize(w)
    folder = mla_load(mla_standin(), [(name, q), (name + "_scale_inv", s)])
    for k in ("w_kc", "w_vc", "w_scale"):
        assert same({k: getattr(synced, k)}, {k: getattr(folder, k)}) == [], k
    # the absorbed weights are the policy's within two FP8 roundings (block, then per tensor)
    ref_kc = w.float().unflatten(0, (-1, 128)).split([64, 64], dim=1)[0]
    got_kc = synced.w_kc.float() * synced.w_scale.float()
    bound = 2 * (2.0**-4 * ref_kc.abs().max() + float(w.float().abs().max()) / 448 * 2.0**-9)
    assert float((got_kc - ref_kc).abs().max()) <= bound
    stale = mla_load(mla_standin(), [(name, q), (name + "_scale_inv", torch.ones_like(s))])
    assert float((stale.w_kc.float() * stale.w_scale.float() - ref_kc).abs().max()) > 10 * bound
