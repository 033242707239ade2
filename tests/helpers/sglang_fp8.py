"""Shared pieces of the FP8 sync tests against SGLang's own code (tests/sglang_real/test_sglang_real_fp8*.py):
SGLang's real FP8 linear layers in a stand-in ``self``, the sync's stream, an FP8 folder written by an
independent per-block loop, and the FP8 rounding bound (derived in test_sglang_real_fp8.py's docstring).
Imported only after the sglang wheel is found on the path (it imports sglang at module level)."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch
from sglang.srt.layers import linear as sgl_linear
from sglang.srt.layers.quantization.fp8 import Fp8Config
from sglang.srt.layers.quantization.fp8_utils import block_quant_dequant
from sglang.srt.models.qwen3 import Qwen3ForCausalLM
from sglang.srt.runtime_context import get_parallel

from srpo_megatron.buckets import PendingParam, TensorSpec, flat_buckets
from srpo_megatron.conversion.fp8_layout import Fp8Layout
from srpo_megatron.weights.fp8_sync import quantize_pending

# Qwen3-8B-FP8's quantization_config (hub config.json), which SGLang's Fp8Config reads.
HUB_QC = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "weight_block_size": [128, 128],
    "activation_scheme": "dynamic",
    "modules_to_not_convert": ["lm_head"],
}
# Hidden 320: partial 64-column edge blocks on every input side; fused shards are whole 128-row blocks,
# as SGLang's validate_block_quant_shapes requires of q/k/v and gate/up.
H, HEAD, NQ, NKV, F = 320, 64, 4, 2, 384
SHAPES = {
    "self_attn.q_proj": (NQ * HEAD, H),
    "self_attn.k_proj": (NKV * HEAD, H),
    "self_attn.v_proj": (NKV * HEAD, H),
    "self_attn.o_proj": (H, NQ * HEAD),
    "mlp.gate_proj": (F, H),
    "mlp.up_proj": (F, H),
    "mlp.down_proj": (H, F),  # 3 x 3 scale grid: a transposed scale still fits the parameter
}
FUSED = {
    "self_attn.qkv_proj": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
    "self_attn.o_proj": ["self_attn.o_proj"],
    "mlp.gate_up_proj": ["mlp.gate_proj", "mlp.up_proj"],
    "mlp.down_proj": ["mlp.down_proj"],
}


@contextlib.contextmanager
def tp1():
    """SGLang's TP group replaced by its own override hook: one rank."""
    with get_parallel().override(tp_size=1, tp_rank=0, attn_tp_size=1, attn_tp_rank=0):
        yield


def fp8_config() -> Fp8Config:
    return Fp8Config.from_config(HUB_QC)


def qwen3_standin(layers: int = 2) -> torch.nn.Module:
    """``self`` for ``Qwen3ForCausalLM.load_weights``: SGLang's real FP8 linear layers under its names."""
    cfg = fp8_config()
    kw = dict(bias=False, quant_config=cfg, params_dtype=torch.bfloat16)
    blocks = torch.nn.ModuleList()
    for i in range(layers):
        p = f"model.layers.{i}."
        block = torch.nn.Module()
        block.self_attn, block.mlp = torch.nn.Module(), torch.nn.Module()
        L = sgl_linear
        block.self_attn.qkv_proj = L.QKVParallelLinear(
            H, HEAD, NQ, NKV, prefix=p + "self_attn.qkv_proj", **kw
        )
        block.self_attn.o_proj = L.RowParallelLinear(NQ * HEAD, H, prefix=p + "self_attn.o_proj", **kw)
        block.mlp.gate_up_proj = L.MergedColumnParallelLinear(H, [F, F], prefix=p + "mlp.gate_up_proj", **kw)
        block.mlp.down_proj = L.RowParallelLinear(F, H, prefix=p + "mlp.down_proj", **kw)
        blocks.append(block)
    stand = torch.nn.Module()
    stand.model = torch.nn.Module()
    stand.model.layers = blocks
    stand.pp_group = SimpleNamespace(is_last_rank=True)
    stand.config = SimpleNamespace(tie_word_embeddings=False)
    return stand


def bf16_weights(layers: int = 2, seed: int = 0) -> dict[str, torch.Tensor]:
    """The trainer's exported bf16 projections (HF names), with varied block magnitudes."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(layers):
        for mod, shape in SHAPES.items():
            scale = torch.rand(shape[0] // 32 + 1, 1, generator=g).repeat_interleave(32, 0)[: shape[0]]
            out[f"model.layers.{i}.{mod}.weight"] = (
                torch.randn(shape, generator=g) * (0.01 + scale)
            ).bfloat16()
    return out


def reference_quantize(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """An independent per-block loop of the DeepGEMM/DeepSeek convention (amax clamp 1e-4, x * 448/amax
    rounded to e4m3, scale_inv = amax / 448), as a hub FP8 folder is written."""
    rows, cols = w.shape
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    s = torch.empty(-(-rows // block), -(-cols // block), dtype=torch.float32)
    for bi in range(s.shape[0]):
        for bj in range(s.shape[1]):
            blk = w[bi * block : (bi + 1) * block, bj * block : (bj + 1) * block].float()
            amax = blk.abs().max().clamp(min=1e-4)
            q[bi * block : (bi + 1) * block, bj * block : (bj + 1) * block] = (blk * (448.0 / amax)).to(
                q.dtype
            )
            s[bi, bj] = amax / 448.0
    return q, s


def sync_stream(weights: dict[str, torch.Tensor], bucket_bytes: int = 200_000):
    """The FP8 sync's stream exactly as a sender makes it: ``PendingParam``s through ``quantize_pending``
    into flat buckets (planned from the announced specs, filled by ``fetch_into``); one list per bucket."""
    pending = [
        PendingParam(
            n, t.numel() * 2, (lambda n=n, t=t: [(n, t.clone())]), (TensorSpec(n, t.dtype, tuple(t.shape)),)
        )
        for n, t in weights.items()
    ]
    return [
        b.views()
        for b in flat_buckets(
            quantize_pending(pending, Fp8Layout.from_quantization_config(HUB_QC, "hub")), bucket_bytes
        )
    ]


def load(stand: torch.nn.Module, buckets) -> None:
    with tp1():
        for bucket in buckets:  # one load_weights call per bucket, as one update request is
            Qwen3ForCausalLM.load_weights(stand, bucket)


def params(stand: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in stand.named_parameters()}


def checkpoint_folder(tmp_path, weights: dict[str, torch.Tensor]) -> list[str]:
    """An FP8 checkpoint folder as the hub ships one: e4m3 weights + fp32 weight_scale_inv (reference)."""
    from safetensors.torch import save_file

    tensors = {}
    for n, w in weights.items():
        q, s = reference_quantize(w)
        tensors[n], tensors[n + "_scale_inv"] = q, s
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    return [str(path)]


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names whose bytes differ (fp8 compared as bytes: NaN-safe, bit for bit)."""
    as_bytes = lambda t: t.view(torch.uint8) if t.element_size() == 1 else t  # noqa: E731
    return [n for n in a if not torch.equal(as_bytes(a[n]), as_bytes(b[n]))]


def within_fp8_rounding(stand: torch.nn.Module, weights: dict[str, torch.Tensor]) -> list[str]:
    """SGLang's block_quant_dequant of each loaded parameter against the bf16 weights (module bound);
    returns the parameters outside it."""
    bad = []
    for i, block in enumerate(stand.model.layers):
        for fused, parts in FUSED.items():
            layer = block.get_submodule(fused)
            got = block_quant_dequant(
                layer.weight.data, layer.weight_scale_inv.data, [128, 128], torch.float32
            )
            want = torch.cat([weights[f"model.layers.{i}.{p}.weight"].float() for p in parts])
            amax = torch.cat([blockwise_amax(weights[f"model.layers.{i}.{p}.weight"].float()) for p in parts])
            bound = (2.0**-4 * want.abs() + amax / 448.0 * 2.0**-10) * (1 + 1e-6)
            if got.shape != want.shape or not bool(((got - want).abs() <= bound).all()):
                bad.append(f"model.layers.{i}.{fused}")
    return bad


def blockwise_amax(w: torch.Tensor, block: int = 128) -> torch.Tensor:
    """Each element's block amax (the per-block scale's numerator), element-wise."""
    _, s = reference_quantize(w, block)
    full = (s * 448.0).repeat_interleave(block, 0).repeat_interleave(block, 1)
    return full[: w.shape[0], : w.shape[1]]
