"""FP8 routed experts of the weight sync through SGLang's real ``FusedMoE`` (marker ``sglang_real``; both
wheels).

What is real here: SGLang's ``FusedMoE`` (``sglang/srt/layers/moe/fused_moe_triton/layer.py``) built with
the hub's ``Fp8Config`` (128 x 128 blocks), so its quant method is the real ``Fp8MoEMethod`` whose
``create_weights`` makes ``w13_weight`` / ``w2_weight`` (e4m3, ``[experts, 2I, H]`` / ``[experts, H, I]``)
and ``w13_weight_scale_inv`` / ``w2_weight_scale_inv`` (fp32 block grids); ``FusedMoE.weight_loader``
places each expert's ``gate_proj`` / ``up_proj`` (``w1`` / ``w3`` halves of ``w13``) and ``down_proj``
(``w2``), weights and scale blocks alike; ``Qwen3MoeForCausalLM.load_weights`` routes the per-expert HF
names through ``FusedMoE.make_expert_params_mapping``; ``safetensors_weights_iterator`` reads the FP8
folder; ``fp8_utils.block_quant_dequant`` dequantizes. Nothing of that is replaced.

Stand-ins: the model object ``self`` (an ``nn.Module`` holding one real ``FusedMoE`` per layer under
SGLang's names, as ``test_sglang_real_fp8.py`` does for the dense layers); SGLang's process groups (its
``get_parallel().override`` test hook, TP1/EP1); and the process-wide ``ServerArgs`` that ``FusedMoE``'s
constructor reads (``get_global_server_args()`` in 0.5.15.post1, ``get_exec().moe`` in 0.5.23): a default
record published with the context's own ``set_server_args`` (0.5.23: ``ServerArgs(model_path=...)``, which
resolves nothing; 0.5.15.post1: the dataclass's defaults, since its ``__post_init__`` looks for an
accelerator), restored afterwards.

DeepSeek-V3: ``DeepseekV3ForCausalLM.load_weights`` (its real ``do_load_weights``) on a stand-in ``self``
holding per layer SGLang's real FP8 ``ReplicatedLinear`` ``fused_qkv_a_proj_with_mqa`` and a real FP8
``FusedMoE``: SGLang itself concatenates the ``q_a_proj`` / ``kv_a_proj_with_mqa`` weights and their
``weight_scale_inv`` grids and loads the experts. Its ``post_load_weights`` is a no-op stand-in here (the
real one is checked on ``kv_b_proj``'s scale in ``test_sglang_real_fp8.py``); the rest of the DeepSeek
model (MLA attention, its backend) cannot be built on CPU and is not part of the loading path checked.
"""

from __future__ import annotations

import contextlib
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from srpo_megatron.conversion.fp8_layout import Fp8Layout
from srpo_megatron.rollout.base import EngineError
from srpo_megatron.rollout.gate import validated_stream
from srpo_megatron.rollout.served_precision import with_fp8_scales
from srpo_megatron.testing import sglang_import
from srpo_megatron.weights import fp8_sync

pytestmark = pytest.mark.sglang_real

REAL = sglang_import.load()
if REAL is None:
    pytest.skip(
        "no sglang wheel on the path (tools/dev test runs this tier with one)", allow_module_level=True
    )

from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE  # noqa: E402
from sglang.srt.layers.quantization.fp8_utils import block_quant_dequant  # noqa: E402
from sglang.srt.model_loader.weight_utils import safetensors_weights_iterator  # noqa: E402
from sglang.srt.models.qwen3_moe import Qwen3MoeForCausalLM  # noqa: E402
from sglang.srt.runtime_context import get_context, get_parallel  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

from tests.helpers.sglang_fp8 import (  # noqa: E402
    blockwise_amax,
    checkpoint_folder,
    fp8_config,
    params,
    same,
    sync_stream,
)

# Hidden 320: partial 64-column edge blocks on w13's input side and w2's output rows; the expert width is
# whole 128 blocks, as Fp8MoEMethod requires of intermediate_size_per_partition.
H, INTER, EXPERTS, LAYERS = 320, 256, 4, 2
PROJ = {"gate_proj": (INTER, H), "up_proj": (INTER, H), "down_proj": (H, INTER)}


@contextlib.contextmanager
def sglang_moe_context():
    """SGLang's process groups at TP1/EP1 (its override hook) and a default ``ServerArgs`` published for
    FusedMoE's constructor; the context's previous record restored on exit."""
    ctx = get_context()
    slots = [n for c in type(ctx).__mro__ for n in getattr(c, "__slots__", ())] or list(vars(ctx))
    saved = {n: getattr(ctx, n) for n in slots if hasattr(ctx, n)}
    parallel_config = getattr(ctx.parallel, "_config", None)
    compile_flag = ctx.flags.capture.enable_torch_compile
    if dataclasses.is_dataclass(ServerArgs):  # 0.5.15.post1: __post_init__ needs an accelerator
        args = object.__new__(ServerArgs)
        for f in dataclasses.fields(ServerArgs):
            if f.default is not dataclasses.MISSING:
                value = f.default
            elif f.default_factory is not dataclasses.MISSING:
                value = f.default_factory()
            else:
                value = None
            setattr(args, f.name, value)
        args.model_path = "/stand-in"
    else:  # 0.5.23: construction resolves nothing
        args = ServerArgs(model_path="/stand-in")
    ctx.set_server_args(args)
    try:
        with get_parallel().override(
            tp_size=1,
            tp_rank=0,
            attn_tp_size=1,
            attn_tp_rank=0,
            moe_ep_size=1,
            moe_ep_rank=0,
            moe_tp_size=1,
            moe_tp_rank=0,
        ):
            yield
    finally:
        for n, v in saved.items():
            setattr(ctx, n, v)
        ctx.flags.capture.enable_torch_compile = compile_flag
        if hasattr(ctx.parallel, "_config"):
            ctx.parallel._config = parallel_config


def moe_standin() -> torch.nn.Module:
    """``self`` for ``Qwen3MoeForCausalLM.load_weights``: one real FP8 ``FusedMoE`` per layer."""
    blocks = torch.nn.ModuleList()
    for i in range(LAYERS):
        block = torch.nn.Module()
        block.mlp = torch.nn.Module()
        block.mlp.experts = FusedMoE(
            num_experts=EXPERTS,
            hidden_size=H,
            intermediate_size=INTER,
            layer_id=i,
            top_k=2,
            quant_config=fp8_config(),
            params_dtype=torch.bfloat16,
            prefix=f"model.layers.{i}.mlp.experts",
        )
        blocks.append(block)
    stand = torch.nn.Module()
    stand.model = torch.nn.Module()
    stand.model.layers = blocks
    stand.pp_group = SimpleNamespace(is_last_rank=True, is_first_rank=True)
    stand.config = SimpleNamespace(num_experts=EXPERTS, tie_word_embeddings=False)
    return stand


def expert_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """The trainer's exported bf16 experts (HF per-expert names), block magnitudes varied."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(LAYERS):
        for e in range(EXPERTS):
            for proj, shape in PROJ.items():
                rows = torch.rand(shape[0] // 32 + 1, 1, generator=g).repeat_interleave(32, 0)[: shape[0]]
                out[f"model.layers.{i}.mlp.experts.{e}.{proj}.weight"] = (
                    torch.randn(shape, generator=g) * (0.01 + rows)
                ).bfloat16()
    return out


def load(stand: torch.nn.Module, buckets) -> None:
    with sglang_moe_context():
        for bucket in buckets:  # one load_weights call per bucket, as one update request is
            Qwen3MoeForCausalLM.load_weights(stand, bucket)


def built() -> torch.nn.Module:
    with sglang_moe_context():
        return moe_standin()


def dequant_outside_rounding(stand: torch.nn.Module, weights: dict[str, torch.Tensor]) -> list[str]:
    """SGLang's block_quant_dequant of each expert's w13 / w2 against the bf16 weights (the bound of
    ``test_sglang_real_fp8.py``'s docstring); returns the (layer, expert, param) outside it."""
    bad = []
    for i, block in enumerate(stand.model.layers):
        moe = block.mlp.experts
        for e in range(EXPERTS):
            p = f"model.layers.{i}.mlp.experts.{e}."
            for param, parts in (("w13", ["gate_proj", "up_proj"]), ("w2", ["down_proj"])):
                w = getattr(moe, f"{param}_weight").data[e]
                s = getattr(moe, f"{param}_weight_scale_inv").data[e]
                got = block_quant_dequant(w, s, [128, 128], torch.float32)
                want = torch.cat([weights[p + q + ".weight"].float() for q in parts])
                amax = torch.cat([blockwise_amax(weights[p + q + ".weight"].float()) for q in parts])
                bound = (2.0**-4 * want.abs() + amax / 448.0 * 2.0**-10) * (1 + 1e-6)
                if not bool(((got - want).abs() <= bound).all()):
                    bad.append(f"{p}{param}")
    return bad


def test_fp8_experts_sync_loads_what_sglang_loads_from_an_fp8_folder(tmp_path):
    """The sync's buckets through SGLang's Qwen3-MoE loader into real FP8 FusedMoEs = the same experts'
    FP8 folder (independent per-block loop) through SGLang's reader and the same loader: w13/w2 weights
    and scales bit for bit; SGLang's dequant of them within FP8 rounding of the policy's bf16."""
    weights = expert_weights()
    buckets = fp8_sync_buckets(weights)
    assert len(buckets) > 1
    synced, from_disk = built(), built()
    load(synced, buckets)
    load(from_disk, [list(safetensors_weights_iterator(checkpoint_folder(tmp_path, weights)))])
    got, want = params(synced), params(from_disk)
    assert set(got) == set(want) and len(got) == 4 * LAYERS
    assert same(got, want) == []
    assert all(bool((t > 0).all()) for n, t in got.items() if n.endswith("scale_inv"))
    assert dequant_outside_rounding(synced, weights) == []


def fp8_sync_buckets(weights: dict[str, torch.Tensor]):
    return sync_stream(weights, bucket_bytes=150_000)


def test_bf16_experts_under_dense_names_are_caught():
    """Planted: today's sync (bf16 experts, no scales) into the FP8 engine. SGLang's FusedMoE loader takes
    them silently; the dequantized experts are not the policy's, and our gate refuses the stream."""
    weights = expert_weights(seed=1)
    stand = built()
    load(stand, [list(weights.items())])  # no error from SGLang
    assert len(dequant_outside_rounding(stand, weights)) == LAYERS * EXPERTS * 2
    manifest = with_fp8_scales({n: tuple(t.shape) for n, t in weights.items()}, Fp8Layout())
    with pytest.raises(EngineError, match="mis-typed tensor"):
        list(validated_stream(weights.items(), manifest, set()))


def test_a_wrong_expert_scale_is_caught(monkeypatch):
    """Planted: the sync's quantizer sends 448/amax (the factor, not its inverse): SGLang loads it into
    every expert's scale and dequantizes garbage; the real quantizer passes the same check."""
    real = fp8_sync.quantize
    monkeypatch.setattr(fp8_sync, "quantize", lambda w, block: (real(w, block)[0], 1.0 / real(w, block)[1]))
    weights = expert_weights(seed=2)
    stand = built()
    load(stand, fp8_sync_buckets(weights))
    assert len(dequant_outside_rounding(stand, weights)) == LAYERS * EXPERTS * 2
    monkeypatch.setattr(fp8_sync, "quantize", real)
    load(stand, fp8_sync_buckets(weights))
    assert dequant_outside_rounding(stand, weights) == []


# DeepSeek-V3: q_lora 128 + (kv_lora 128 + rope 64): the fused q_a / kv_a parameter is [320, H], its scale
# grid the two halves' grids stacked (q_a's rows are whole 128 blocks, as SGLang's fusion needs).
Q_LORA, KV_A = 128, 192


def deepseek_standin() -> torch.nn.Module:
    """``self`` for ``DeepseekV3ForCausalLM.load_weights``: per layer SGLang's real FP8
    ``ReplicatedLinear`` ``fused_qkv_a_proj_with_mqa`` and a real FP8 ``FusedMoE``; ``post_load_weights``
    is a recording stand-in (the real one is checked on ``kv_b_proj`` in ``test_sglang_real_fp8.py``)."""
    from sglang.srt.layers.linear import ReplicatedLinear

    stand = moe_standin()
    for i, block in enumerate(stand.model.layers):
        block.self_attn = torch.nn.Module()
        block.self_attn.fused_qkv_a_proj_with_mqa = ReplicatedLinear(
            H,
            Q_LORA + KV_A,
            bias=False,
            quant_config=fp8_config(),
            params_dtype=torch.bfloat16,
            prefix=f"model.layers.{i}.self_attn.fused_qkv_a_proj_with_mqa",
        )
    stand.model.start_layer, stand.model.end_layer = 0, LAYERS
    stand.config = SimpleNamespace(
        num_hidden_layers=LAYERS,
        n_routed_experts=EXPERTS,
        num_experts=EXPERTS,
        q_lora_rank=Q_LORA,
        architectures=["DeepseekV3ForCausalLM"],
        num_nextn_predict_layers=0,
        tie_word_embeddings=False,
    )
    stand.quant_config, stand.num_fused_shared_experts = fp8_config(), 0
    stand.post_load_weights = lambda is_nextn=False, weight_names=None: None
    return stand


def deepseek_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """Per layer in the export's order: q_a_proj, kv_a_proj_with_mqa (the order ``_FusedPairs`` keeps in
    one bucket), then the experts."""
    g = torch.Generator().manual_seed(seed + 100)
    experts = expert_weights(seed)
    out = {}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_a_proj.weight"] = (torch.randn(Q_LORA, H, generator=g) * 0.05).bfloat16()
        out[p + "self_attn.kv_a_proj_with_mqa.weight"] = (torch.randn(KV_A, H, generator=g) * 0.2).bfloat16()
        out.update({n: w for n, w in experts.items() if n.startswith(p)})
    return out


def deepseek_load(stand: torch.nn.Module, buckets) -> None:
    import types

    from sglang.srt.models.deepseek_v2 import DeepseekV3ForCausalLM as cls

    for attr in ("do_load_weights", "_initialize_nextn_conf", "_maybe_quant_weights_to_fp8_ue8m0"):
        if hasattr(cls, attr):
            setattr(stand, attr, types.MethodType(getattr(cls, attr), stand))
    with sglang_moe_context():
        for bucket in buckets:
            cls.load_weights(stand, bucket)


def test_deepseek_fp8_fused_qkv_a_and_experts_load_like_the_folder(tmp_path):
    """DeepSeek-V3's own load_weights: the sync's q_a / kv_a scales and weights (kept in one bucket by
    ``buckets._FusedPairs``) fuse into the real FP8 ``fused_qkv_a_proj_with_mqa`` exactly as the FP8
    folder's do, and the experts load into the real FusedMoE bit for bit."""
    weights = deepseek_weights()
    buckets = sync_stream(weights, bucket_bytes=60_000)
    assert len(buckets) > 2
    with sglang_moe_context():
        synced, from_disk = deepseek_standin(), deepseek_standin()
    deepseek_load(synced, buckets)
    deepseek_load(from_disk, [list(safetensors_weights_iterator(checkpoint_folder(tmp_path, weights)))])
    got, want = params(synced), params(from_disk)
    assert set(got) == set(want) and len(got) == 6 * LAYERS
    assert same(got, want) == []
    assert all(bool((t > 0).all()) for n, t in got.items() if n.endswith("scale_inv"))
    fused = synced.model.layers[1].self_attn.fused_qkv_a_proj_with_mqa
    deq = block_quant_dequant(fused.weight.data, fused.weight_scale_inv.data, [128, 128], torch.float32)
    p = "model.layers.1.self_attn."
    ref = torch.cat([weights[p + "q_a_proj.weight"], weights[p + "kv_a_proj_with_mqa.weight"]]).float()
    assert float((deq - ref).abs().max()) <= 2.0**-4 * float(ref.abs().max()) * (1 + 1e-6)
    assert dequant_outside_rounding(synced, weights) == []


def test_deepseek_qa_kva_split_over_two_requests_is_caught(tmp_path):
    """Planted: the pair split over two load_weights calls (what ``_FusedPairs`` prevents): SGLang drops
    both halves silently and the fused parameter keeps its initial bytes; the comparison sees it."""
    weights = deepseek_weights(seed=1)
    planted = []
    for bucket in sync_stream(weights, bucket_bytes=60_000):
        names = [n for n, _ in bucket]
        cut = next((k + 1 for k, n in enumerate(names) if n.endswith("q_a_proj.weight")), None)
        planted += [bucket] if cut is None else [bucket[:cut], bucket[cut:]]
    with sglang_moe_context():
        synced, from_disk = deepseek_standin(), deepseek_standin()
    deepseek_load(synced, planted)
    deepseek_load(from_disk, [list(safetensors_weights_iterator(checkpoint_folder(tmp_path, weights)))])
    bad = same(params(synced), params(from_disk))
    assert sorted({n.split(".self_attn.")[1] for n in bad}) == [
        "fused_qkv_a_proj_with_mqa.weight",
        "fused_qkv_a_proj_with_mqa.weight_scale_inv",
    ]
    assert len(bad) == 2 * LAYERS
