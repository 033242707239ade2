"""Blockwise FP8 weight sync: the export stream with every FP8-layout weight quantized on the sender.

An SGLang engine serving a blockwise FP8 folder (``rollout.served_precision``) holds, for every weight
``conversion.fp8_layout.Fp8Layout`` keeps in FP8, two parameters created by its block-FP8 linear method
(``sglang/srt/layers/quantization/fp8.py::Fp8LinearMethod.create_weights``): ``weight`` ``float8_e4m3fn``
``[out, in]`` and ``weight_scale_inv`` ``float32`` ``[ceil(out/128), ceil(in/128)]``, loaded by name
through the same ``load_weights`` as a checkpoint (``...proj.weight`` and ``...proj.weight_scale_inv``,
stacked into ``qkv_proj`` / ``gate_up_proj`` / the fused experts by SGLang's own weight loaders). So the
sync sends exactly a checkpoint's tensors: :func:`quantize_pending` wraps each ``PendingParam`` of the
export stream (``weights.export``, after ``weights.fused_experts``) whose announced HF tensors include an
FP8 weight, and its ``fetch`` returns ``(<name>_scale_inv, fp32)`` then ``(<name>, e4m3)`` in place of the
bf16 tensor (``ops.fp8_blocks.quantize``: DeepGEMM's ``per_block_cast_to_fp8``, amax / 448 per block); all
other tensors pass unchanged (bf16). DeepSeek MLA's ``post_load_weights`` re-derives ``w_kc``/``w_vc``
from ``kv_b_proj.weight`` dequantized with ``kv_b_proj.weight_scale_inv``: both arrive in the same call.

The scale goes *before* its weight: SGLang's DeepSeek loader fuses ``q_a_proj`` and ``kv_a_proj_with_mqa``
(weights and scales alike) only when both halves arrive in one ``load_weights`` call, and
``buckets._FusedPairs`` keeps the pair in one bucket from the first ``q_a_proj`` tensor to the
``kv_a_proj_with_mqa`` weight, which is then the pair's last tensor.

Where: on the sender's device (the trainer's GPU), one parameter at a time inside the bucket being
filled: the parameter's bf16 tensor, its fp32 copy padded to whole blocks, then one byte per element into
the bucket (2.5 B/element moved instead of 2). Every sender does it, so the colocated (tensor), disk and
broadcast strategies all send the same bytes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from srpo_megatron.buckets import PendingParam, TensorSpec
from srpo_megatron.conversion.fp8_layout import Fp8Layout
from srpo_megatron.ops.fp8_blocks import quantize


def fp8_specs(spec: TensorSpec, layout: Fp8Layout) -> list[TensorSpec]:
    """The tensors one announced bf16 tensor becomes: itself, or its scale then its FP8 weight."""
    if not (layout.is_fp8(spec.name) and len(spec.shape) == 2):
        return [spec]
    br, bc = layout.block
    grid = (-(-spec.shape[0] // br), -(-spec.shape[1] // bc))
    return [
        TensorSpec(layout.scale_name(spec.name), torch.float32, grid),
        TensorSpec(spec.name, torch.float8_e4m3fn, tuple(spec.shape)),
    ]


def quantize_named(
    named: Iterable[tuple[str, torch.Tensor]], layout: Fp8Layout
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` with each FP8-layout 2-D weight replaced by its scale and its e4m3 weight."""
    for name, t in named:
        if layout.is_fp8(name) and t.dim() == 2:
            q, scale_inv = quantize(t, layout.block)
            yield layout.scale_name(name), scale_inv
            yield name, q
        else:
            yield name, t


def _quantized(p: PendingParam, layout: Fp8Layout) -> PendingParam:
    specs = None if p.specs is None else tuple(s for spec in p.specs for s in fp8_specs(spec, layout))

    def fetch() -> list[tuple[str, torch.Tensor]]:
        return list(quantize_named(p.fetch(), layout))

    def fetch_into(out: list[torch.Tensor]) -> None:
        got = fetch()
        if [n for n, _ in got] != [s.name for s in specs]:
            raise ValueError(f"{p.name}: fetch returned {[n for n, _ in got]}, announced {specs}")
        for view, (_, t) in zip(out, got, strict=True):
            view.copy_(t)

    nbytes = p.nbytes if specs is None else sum(s.nbytes for s in specs)
    return PendingParam(p.name, nbytes, fetch, specs, None if specs is None else fetch_into)


def quantize_pending(pending: Iterable[PendingParam], layout: Fp8Layout | None) -> Iterator[PendingParam]:
    """The export stream for an engine serving ``layout`` (None: bf16, unchanged). Parameters whose
    announced tensors hold no FP8 weight (and every parameter on ranks that receive nothing) pass as they
    are, so the TP/EP gathers inside ``fetch`` stay matched across ranks."""
    for p in pending:
        if layout is None or (p.specs is not None and not any(layout.is_fp8(s.name) for s in p.specs)):
            yield p
        else:
            yield _quantized(p, layout)
