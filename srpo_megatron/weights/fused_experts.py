"""Fuse the per-expert slices ``x[e]`` of a weight-sync stream into the whole HF tensors ``x`` (gpt-oss).

The conversion table names expert ``e``'s slice of a fused HF tensor ``x`` (gpt-oss: ``gate_up_proj``
``[E, H, 2F]``, ``down_proj`` ``[E, F, H]``, their biases) as ``x[e]`` (``conversion.table.slice_name``), and
``weights.export`` streams one slice per expert parameter. SGLang's ``GptOssForCausalLM.load_weights``
reads only the whole fused tensors (it splits them per expert and EP rank itself), so the SGLang-bound
syncs pass their stream through :func:`fuse_expert_slices`: the sender builds each fused tensor from its
``E`` slices (after the EP/ETP gathers of ``weights.export``), each slice placed at its index ``e``, every
``e`` exactly once, checked from the announced specs before anything is gathered.

The slices of one layer arrive interleaved in model order (expert 0's fc1 weight, its bias, fc2, ...), so a
layer's expert parameters are held back unfetched and re-ordered per fused tensor: every rank does the same
(all ranks of a stage must call this on the same stream), hence the gathers stay matched. Memory: a fused
tensor is one "parameter" for the bucketers (``buckets.flat_buckets`` writes the slices straight into its
place in the bucket), so a bucket may exceed ``bucket_bytes`` by up to one fused tensor (gpt-oss-20b's
``gate_up_proj``: 32 x 2880 x 5760 x 2 B = 1.06 GB in bf16), plus one expert parameter's gather in flight.
Streams without slices pass through unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch

from srpo_megatron.buckets import PendingParam, TensorSpec
from srpo_megatron.conversion.table import ConversionTable, slice_name


class SliceOrderError(ValueError):
    """The slices announced for a fused tensor are not each expert exactly once."""


def _base(table: ConversionTable, name: str) -> str | None:
    hf = table.hf_names_for(name)
    sliced = slice_name(hf[0]) if len(hf) == 1 else None
    return sliced[0] if sliced else None


def _fused_spec(base: str, parts: list[PendingParam], num_experts: int) -> TensorSpec | None:
    """The fused tensor's spec from its parts' announced slice specs (None on a rank that gets nothing)."""
    specs = [s for p in parts for s in (p.specs or ())]
    if not specs:
        return None
    indices = []
    for s in specs:
        sliced = slice_name(s.name)
        if sliced is None or sliced[0] != base:
            raise SliceOrderError(f"{s.name!r} is not a slice of {base!r}: only {base}[e] can be fused")
        indices.append(sliced[1])
    if sorted(indices) != list(range(num_experts)):
        missing = sorted(set(range(num_experts)) - set(indices))
        twice = sorted({e for e in indices if indices.count(e) > 1})
        raise SliceOrderError(
            f"{base}: the stream announces experts {indices}, not each of 0..{num_experts - 1} once "
            f"(missing {missing}, repeated {twice}); an EP/ETP gather in weights/export.py lost or "
            "duplicated an expert"
        )
    if len({(s.dtype, s.shape) for s in specs}) != 1:
        raise SliceOrderError(f"{base}: the slices differ in dtype or shape: {specs}")
    return TensorSpec(base, specs[0].dtype, (num_experts, *specs[0].shape))


def _fused(base: str, parts: list[PendingParam], num_experts: int) -> PendingParam:
    spec = _fused_spec(base, parts, num_experts)

    def gather(place) -> None:
        for p in parts:  # every rank calls every part's fetch, in the same order (they are collectives)
            got = p.fetch()
            if spec is None:
                continue
            announced = [s.name for s in p.specs or ()]
            if (names := [n for n, _ in got]) != announced:
                raise SliceOrderError(f"{p.name}: fetch returned {names}, announced {announced}")
            for name, t in got:
                place(slice_name(name)[1], t)
            del got

    def fetch_into(out: list[torch.Tensor]) -> None:
        gather(lambda e, t: out[0][e].copy_(t))

    def fetch() -> list[tuple[str, torch.Tensor]]:
        full: list[torch.Tensor] = []

        def place(e: int, t: torch.Tensor) -> None:
            if not full:  # allocated on the slices' device once the first one arrives
                full.append(t.new_empty(spec.shape))
            full[0][e].copy_(t)

        gather(place)
        return [(base, full[0])] if full else []

    nbytes = 0 if spec is None else math.prod(spec.shape) * spec.dtype.itemsize
    return PendingParam(base, nbytes, fetch, (spec,) if spec else (), fetch_into)


def fuse_expert_slices(pending: Iterable[PendingParam], table: ConversionTable) -> Iterator[PendingParam]:
    """``pending`` (``weights.export.iter_stage_params``) with each layer's expert slices ``x[e]`` replaced by
    one ``PendingParam`` per fused tensor ``x`` (module docstring); everything else unchanged, in order."""
    held: dict[str, list[PendingParam]] = {}
    layer = None
    num_experts = table.arch.num_experts
    for p in pending:
        base = _base(table, p.name)
        here = base.rsplit(".mlp.", 1)[0] if base else None
        if held and here != layer:
            yield from (_fused(b, parts, num_experts) for b, parts in held.items())
            held = {}
        if base is None:
            yield p
            continue
        layer = here
        held.setdefault(base, []).append(p)
    yield from (_fused(b, parts, num_experts) for b, parts in held.items())
