"""The output layer fused into the vocab-parallel kernels: hidden states in, never a ``[T, V/TP]`` logits.

``OutputShard(hidden [T, H], weight [V/P, H])`` stands for the logits shard ``hidden @ weight.T`` of a
tensor-parallel group (rank r holds vocabulary rows ``[r·V/P, (r+1)·V/P)``, as megatron's
``ColumnParallelLinear`` output layer). ``ops.vocab_parallel.token_stats`` accepts it wherever it accepts
logits and returns the same values: log-probs at ids, the global top-k, the entropy.

- **Forward**, chunk by chunk over tokens: one GEMM ``hidden[a:b] @ weight.T`` in the weight's dtype
  (the output layer's own product), padded vocabulary ids masked to ``finfo(dtype).min / 4`` (as
  ``trainer/microbatches/output_rows.logit_rows`` masks materialised logits), then the kernel's chunk
  statistics in the compute dtype. Only ``[T]`` statistics are kept; the most alive at once is a few
  ``chunk × V/P`` buffers.
- **Backward** recomputes each chunk's logits, forms ∂L/∂logits of the chunk with the kernel's formula
  (``vocab_parallel.backward_chunks``), and accumulates ∂L/∂hidden (``g @ weight``) and ∂L/∂weight
  (``gᵀ @ hidden``; in fp32 for half-precision weights, rounded once at the end). Padded ids get no
  gradient. Under TP the hidden gradient is this rank's partial sum, exactly what ``ColumnParallelLinear``
  returns before its input's reduce: the caller's megatron region op (``copy_to`` /
  ``gather_from_sequence_parallel_region``) reduces it, as for the output layer itself.
- **Weight gradient precision** (:func:`wgrad_mode`): on CUDA with half-precision weights each block's
  ``gᵀ @ hidden`` is a bf16/fp16 GEMM accumulated in fp32 into the fp32 ∂L/∂weight, as megatron's output
  layer does (``ColumnParallelLinear`` backward: apex ``fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32``
  into ``main_grad`` under gradient-accumulation fusion, megatron-core 0.16.1
  ``tensor_parallel/layers.py``): apex's kernel where it imports, else ``torch.addmm(..., out_dtype=fp32)``
  (cuBLAS, fp32 accumulation) where this torch has it, else a half-precision product added in fp32 (each
  block's product rounded once, as megatron's unfused ``grad_output.t().matmul(total_input)``). The
  gradient is rounded to the weight's dtype once at the end. On CPU (and for fp32/fp64 weights) the GEMM
  stays fp32 (``WGRAD_HALF = "force"`` runs the half path on CPU, for tests).
- Tied embeddings: ``weight`` is the embedding parameter itself, so both uses accumulate into one grad.
- ``mix`` (forward only): the logits ``(1 − α)·hidden @ weight.T + α·mix.hidden @ mix.weight.T`` of the
  trust-region teacher (``teacher.kind: trust_region``) without materialising either model's logits.

Sequence parallelism and the row selection happen before: ``trainer/microbatches/output_rows.py`` gathers the
sequence-parallel hidden states with megatron's own region op and picks the response rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from srpo_megatron.ops.vocab_parallel import (
    _chunk_rows,
    _compute_dtype,
    _forward_stats,
    _group_rank_size,
    backward_chunks,
    grad_inputs,
)

# Rows per GEMM on CPU: a GEMM of this many rows runs near the machine's matmul speed, where the kernel's
# cache-sized chunk (1 MiB / V·4 bytes: one row at a 152k vocabulary) would make it a GEMV. One fp32 block
# buffer is the fused path's largest work tensor (256 × V/TP × 4 bytes: 0.06 of a 4k-token logits shard).
MIN_CHUNK_ROWS_CPU = 256

# The half-precision weight-gradient GEMM (module doc): "auto" = on CUDA for bf16/fp16 weights; "force" =
# also on CPU (tests); "off" = always the fp32 GEMM.
WGRAD_HALF = "auto"


def wgrad_mode(weight: torch.Tensor) -> str:
    """How the backward forms ∂L/∂weight: ``fp32`` (fp32 GEMM of upcast blocks) or the half-precision GEMM
    with fp32 accumulation: ``apex`` (``wgrad_gemm_accum_fp32``), ``torch`` (``addmm`` with
    ``out_dtype``), ``half`` (half product, fp32 add). See the module doc."""
    half = weight.dtype in (torch.bfloat16, torch.float16)
    if not half or WGRAD_HALF == "off" or (WGRAD_HALF == "auto" and weight.device.type != "cuda"):
        return "fp32"
    if weight.device.type == "cuda" and weight.dtype == torch.bfloat16 and _apex_wgrad() is not None:
        return "apex"
    return "torch" if _addmm_out_dtype(weight.device, weight.dtype) else "half"


def _apex_wgrad():
    """apex's ``fused_weight_gradient_mlp_cuda`` module, or None where it does not import."""
    try:
        import fused_weight_gradient_mlp_cuda
    except ImportError:
        return None
    return fused_weight_gradient_mlp_cuda


_ADDMM_OUT_DTYPE: dict[tuple[str, torch.dtype], bool] = {}


def _addmm_out_dtype(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.addmm(acc32, a, b, out_dtype=float32, out=acc32)`` runs on ``device`` for ``dtype``
    inputs and accumulates in place (probed once on a small problem against the fp32 product)."""
    key = (device.type, dtype)
    if key not in _ADDMM_OUT_DTYPE:
        a = torch.arange(12, device=device).reshape(3, 4).to(dtype)
        b = torch.arange(8, device=device).reshape(4, 2).to(dtype)
        acc = torch.ones(3, 2, device=device)
        try:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            ok = bool(torch.equal(acc, 1 + a.float() @ b.float()))
        except (RuntimeError, NotImplementedError, TypeError):
            ok = False
        _ADDMM_OUT_DTYPE[key] = ok
    return _ADDMM_OUT_DTYPE[key]


def _accumulate_wgrad(mode: str, grad_w: torch.Tensor, g: torch.Tensor, h: torch.Tensor, half) -> None:
    """``grad_w += gᵀ @ h`` (grad_w fp32 [V/P, H], g [n, V/P], h [n, H]) per ``mode`` (:func:`wgrad_mode`);
    ``half``: the half-precision dtype of the GEMM inputs."""
    if mode == "fp32":
        grad_w.addmm_(g.t(), h if h.dtype == grad_w.dtype else h.to(grad_w.dtype))
        return
    g, h = g.to(half), h.to(half)
    if mode == "apex":  # megatron's call: (total_input [n, H], grad_output [n, V/P], main_grad [V/P, H])
        _apex_wgrad().wgrad_gemm_accum_fp32(h, g, grad_w)
    elif mode == "torch":
        torch.addmm(grad_w, g.t(), h, out_dtype=torch.float32, out=grad_w)
    else:
        grad_w.add_(torch.mm(g.t(), h))


@dataclass(frozen=True)
class OutputShard:
    """Logits ``hidden @ weight.T`` of one TP rank, unapplied (module doc).

    hidden:    [..., H] the last hidden states of the rows to score (after the final norm)
    weight:    [V/P, H] this rank's output-layer (or tied embedding) shard
    vocab_pad: [V/P] bool, the padded vocabulary ids of this shard (masked), or None
    mix:       (α, other): forward-only logits mix (1 − α)·self + α·other, or None
    """

    hidden: torch.Tensor
    weight: torch.Tensor
    vocab_pad: torch.Tensor | None = None
    mix: tuple[float, OutputShard] | None = None

    def __post_init__(self) -> None:
        if self.hidden.shape[-1] != self.weight.shape[-1]:
            raise ValueError(
                f"hidden {tuple(self.hidden.shape)} and weight {tuple(self.weight.shape)} disagree on the "
                "hidden size; pass the output layer's [V/P, H] weight shard"
            )
        if self.mix is not None and self.mix[1].rows_shape != self.rows_shape:
            raise ValueError("a mixed OutputShard needs the same rows in both parts")

    @property
    def rows_shape(self) -> torch.Size:
        return self.hidden.shape[:-1]

    @property
    def vocab_shard(self) -> int:
        return int(self.weight.shape[0])

    @property
    def device(self) -> torch.device:
        return self.hidden.device

    def logits(self) -> torch.Tensor:
        """The materialised logits shard [..., V/P] (tests and the unfused comparison only)."""
        return _HiddenSource(self, 1).gemm(0, self.hidden[..., 0].numel()).view(*self.rows_shape, -1)

    def stats(self, ids, k, topk_rows, group, temperature, with_entropy, chunk_tokens):
        """``token_stats``'s request on these logits (see ``vocab_parallel.UnappliedOutput``)."""
        if self.mix is not None:
            if torch.is_grad_enabled() and (self.hidden.requires_grad or self.weight.requires_grad):
                raise ValueError("a mixed OutputShard is forward-only (the trust-region teacher's scoring)")
            return _fused_forward(self, ids, k, topk_rows, group, temperature, with_entropy, chunk_tokens)[1:]
        return _FusedOutputStats.apply(
            self.hidden,
            self.weight,
            ids,
            k,
            topk_rows,
            group,
            temperature,
            with_entropy,
            chunk_tokens,
            self.vocab_pad,
        )


class _HiddenSource:
    """``LogitsSource`` of an ``OutputShard``: the logits by one GEMM per block of ``block`` rows.

    The kernel's chunks (``chunk`` rows, ``block`` a multiple of it) are served from the current block, so
    the statistics run over exactly the chunks they run over on materialised logits: the same reduction
    order, hence the same values as today's path, while the GEMM gets enough rows to run at matmul speed.
    """

    def __init__(self, shard: OutputShard, block: int, release_at_end: bool = False):
        self.h = shard.hidden.reshape(-1, shard.hidden.shape[-1])  # [N, H]
        self.w = shard.weight
        self.pad = shard.vocab_pad  # an all-False mask fills nothing: no host sync to skip it
        self.mix = None
        if shard.mix is not None:
            alpha, other = shard.mix
            self.mix = (alpha, _HiddenSource(other, block))
        self.rows, self.vocab_shard = int(self.h.shape[0]), int(self.w.shape[0])
        self.dtype, self.device = self.w.dtype, self.h.device
        self.block = block
        self._buf: torch.Tensor | None = None
        self._held = (0, 0)  # the rows [a0, b0) in ``_buf``
        # forward passes: let the block buffer go with the last chunk's view, so it is not held through the
        # kernel's collectives and top-k ordering (at TP2 that pushed the extra memory over 0.1 of a shard)
        self.release_at_end = release_at_end

    def gemm(self, a: int, b: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """The logits rows [a, b) in the weight's dtype, padded ids masked, the mix applied."""
        h = self.h[a:b]
        if h.dtype != self.w.dtype:
            h = h.to(self.w.dtype)
        z = torch.mm(h, self.w.t(), out=out) if out is not None else torch.mm(h, self.w.t())
        if self.pad is not None:
            z.masked_fill_(self.pad, torch.finfo(z.dtype).min / 4)
        if self.mix is not None:
            alpha, other = self.mix
            z = z.mul_(1 - alpha).add_(other.gemm(a, b), alpha=alpha)
        return z

    def block_buffer(self) -> torch.Tensor:
        """The current block's logits buffer [block, V/P] (the backward reuses it for their gradient)."""
        assert self._buf is not None
        return self._buf

    def bounds(self, a: int) -> tuple[int, int]:
        """The block that holds row ``a``."""
        a0 = (a // self.block) * self.block
        return a0, min(self.rows, a0 + self.block)

    def chunk(self, a: int, b: int, cdt: torch.dtype, temperature: float, out: torch.Tensor) -> torch.Tensor:
        a0, b0 = self.bounds(a)
        if self._held != (a0, b0):
            if self._buf is None:
                self._buf = torch.empty(self.block, self.vocab_shard, dtype=self.dtype, device=self.device)
            self.gemm(a0, b0, self._buf[: b0 - a0])
            self._held = (a0, b0)
        assert self._buf is not None and b <= b0  # chunks never straddle blocks (block % chunk == 0)
        z = self._buf[a - a0 : b - a0]
        if self.release_at_end and b == self.rows:  # the caller's view keeps it alive while it is used
            self._buf, self._held = None, (0, 0)
        if z.dtype == cdt and temperature == 1.0:
            return z  # the kernel never writes into a chunk it was given
        out.copy_(z)
        return out if temperature == 1.0 else out.div_(temperature)


def _chunks(vocab_shard: int, chunk_tokens: int | None, device: torch.device) -> tuple[int, int]:
    """(kernel chunk rows, GEMM block rows): the kernel's own chunking, and on CPU blocks of at least
    ``MIN_CHUNK_ROWS_CPU`` rows (a multiple of the chunk)."""
    chunk = _chunk_rows(vocab_shard, chunk_tokens, device)
    least = MIN_CHUNK_ROWS_CPU if device.type == "cpu" else chunk
    return chunk, chunk * -(-max(chunk, least) // chunk)


def _fused_forward(shard: OutputShard, ids, k, topk_rows, group, temperature, with_entropy, chunk_tokens):
    chunk, block = _chunks(shard.vocab_shard, chunk_tokens, shard.device)
    with torch.no_grad():
        return _forward_stats(
            _HiddenSource(shard, block, release_at_end=True),
            ids,
            k,
            topk_rows,
            group,
            temperature,
            with_entropy,
            chunk,
        )


class _FusedOutputStats(torch.autograd.Function):
    """``token_stats`` on ``hidden @ weight.T`` with gradients for ``hidden`` and ``weight`` (module doc)."""

    @staticmethod
    def forward(ctx, hidden, weight, ids, k, topk_rows, group, temperature, with_entropy, chunk_tokens, pad):
        chunk, block = _chunks(weight.shape[0], chunk_tokens, hidden.device)
        src = _HiddenSource(OutputShard(hidden, weight, pad), block, release_at_end=True)
        lse, logp, topk_logp, topk_ids, ent = _forward_stats(
            src, ids, k, topk_rows, group, temperature, with_entropy, chunk
        )
        ctx.save_for_backward(hidden, weight, ids, topk_ids, lse, ent, pad)
        ctx.group, ctx.temperature, ctx.chunk, ctx.block = group, temperature, chunk, block
        ctx.mark_non_differentiable(topk_ids)
        ctx.set_materialize_grads(False)
        return logp, topk_logp, topk_ids, ent

    @staticmethod
    def backward(ctx, g_logp, g_topk, _g_ids, g_ent):
        hidden, weight, ids, topk_ids, lse, ent, pad = ctx.saved_tensors
        none = (None,) * 8
        all_ids, all_g, g_ent = grad_inputs(ids, topk_ids, g_logp, g_topk, g_ent, ent, lse.dtype)
        if all_g is None and g_ent is None:
            return (None, None, *none)
        src = _HiddenSource(OutputShard(hidden, weight, pad), ctx.block)
        h2 = src.h
        rank, _ = _group_rank_size(ctx.group)
        cdt = lse.dtype
        grad_h = torch.empty_like(h2) if ctx.needs_input_grad[0] else None
        acc_dt = _compute_dtype(weight.dtype)  # accumulate over blocks in fp32 (fp64 stays fp64)
        mode = wgrad_mode(weight) if ctx.needs_input_grad[1] else "fp32"
        grad_w = (
            torch.zeros(weight.shape, dtype=acc_dt, device=weight.device) if ctx.needs_input_grad[1] else None
        )
        # The block's ∂L/∂logits: in the compute dtype, written over the block's logits (each chunk's rows
        # are consumed before its gradient exists) unless the logits are in another dtype (bf16 weights).
        own = (
            None
            if src.dtype == cdt
            else torch.empty(ctx.block, src.vocab_shard, dtype=cdt, device=hidden.device)
        )
        for a, b, g in backward_chunks(
            src, all_ids, all_g, g_ent, lse, ent, rank, ctx.temperature, ctx.chunk
        ):
            a0, b0 = src.bounds(a)
            g_block = src.block_buffer() if own is None else own
            g_block[a - a0 : b - a0] = g
            if b < b0:
                continue
            # the block's ∂L/∂logits is complete: two GEMMs, as the output layer's backward does
            gb = g_block[: b0 - a0]
            if src.pad is not None:
                gb.masked_fill_(src.pad, 0.0)
            if grad_h is not None:
                grad_h[a0:b0] = torch.mm(gb if gb.dtype == weight.dtype else gb.to(weight.dtype), weight)
            if grad_w is not None:
                _accumulate_wgrad(mode, grad_w, gb, h2[a0:b0], weight.dtype)
        gh = None if grad_h is None else grad_h.view(hidden.shape)
        gw = None if grad_w is None else grad_w.to(weight.dtype)
        return (gh, gw, *none)
