"""Vocabulary-parallel log-probs, entropy and top-k over a logits shard — exact, chunked, input-safe.

Every function takes the local logits shard ``[..., V/TP]`` of a tensor-parallel group and the group
itself (``group=None`` means the logits are the whole vocabulary and no collective is issued). Rank r
of a group of size P holds global vocabulary ids ``[r * V/P, (r + 1) * V/P)`` (megatron's
``VocabUtility`` convention; V is the padded vocabulary, shard size × P). Results are replicated on every
rank of the group; the gradient w.r.t. a rank's shard is that shard's slice of the full-vocabulary
gradient (megatron's convention for ``vocab_parallel_cross_entropy``), so no gradient all-reduce is
needed here.

How it stays exact and small:

- The full vocabulary is never gathered. Per row, each rank reduces its shard to a local max, a local
  Σ exp(z − max), a local Σ exp(z − max)·(z − max) (for the entropy), the logits at the requested ids that
  it owns, and its local top-k; then one MAX and one SUM all-reduce (plus one all-gather of k candidates
  per row for top-k) combine them.
- Work is done in chunks of rows (tokens) through three reusable work buffers of about
  ``DEFAULT_CHUNK_BYTES`` each (cache-sized: each element is touched several times while still in
  cache, and no fresh pages are faulted in per chunk). Backward saves only ``[T]`` statistics and
  recomputes the softmax per chunk instead of saving ``[T, V]`` probabilities; the only full-size
  allocation is the gradient itself. Forward: amax, subtract, exp, sum (+ one dot for the entropy);
  backward: subtract, exp, one multiply (two more for the entropy), a scatter of the id gradients.
- Inputs are never modified (megatron's ``vocab_parallel_cross_entropy`` rewrites fp32 logits in place;
  this module does not).
- fp32 and bf16/fp16 logits are computed in fp32; fp64 logits stay fp64. Outputs have the compute dtype;
  gradients have the logits' dtype.

Top-k ties are broken towards the lower global id, so the chosen ids do not depend on the TP size.
``temperature`` τ divides the logits before the softmax (z = logits / τ), as in sampling.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple, Protocol

import torch
import torch.distributed as dist

from srpo_megatron.ops.deferred_checks import check

# Bytes of one [rows, V/P] fp32 work buffer (a call uses up to three). On CPU small enough to stay in
# cache; on accelerators large enough that kernel launches per chunk do not dominate.
DEFAULT_CHUNK_BYTES = 1 << 20
DEFAULT_CHUNK_BYTES_ACCELERATOR = 128 << 20


class VocabStats(NamedTuple):
    """What ``token_stats`` returns (all replicated across the TP group).

    logp:      [N, J] log p at the requested global ids (empty [N, 0] if none were requested)
    topk_logp: [N, k] exact full-vocabulary log-probs of the global top-k, descending (empty if k == 0)
    topk_ids:  [N, k] their global ids (int64, no gradient)
    entropy:   [N] full-vocabulary entropy (empty [0] unless requested)
    """

    logp: torch.Tensor
    topk_logp: torch.Tensor
    topk_ids: torch.Tensor
    entropy: torch.Tensor


def _group_rank_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None:
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunk_rows(vocab_shard: int, chunk_tokens: int | None, device: torch.device) -> int:
    if chunk_tokens:
        return max(1, int(chunk_tokens))
    budget = DEFAULT_CHUNK_BYTES if device.type == "cpu" else DEFAULT_CHUNK_BYTES_ACCELERATOR
    return max(1, budget // (4 * max(1, vocab_shard)))


class _Workspace:
    """Chunk-sized work buffers, allocated once per call and reused for every chunk.

    Fresh [rows, V/P] allocations per chunk would each be new pages for the OS to fault in; reusing a
    few small buffers keeps the working set in cache and the page faults to one round.
    """

    def __init__(self, rows: int, vocab_shard: int, cdt: torch.dtype, count: int, device: torch.device):
        self.bufs = [torch.empty(rows, vocab_shard, dtype=cdt, device=device) for _ in range(count)]

    def get(self, i: int, rows: int) -> torch.Tensor:
        return self.bufs[i][:rows]


def _scaled(x: torch.Tensor, cdt: torch.dtype, temperature: float, out: torch.Tensor) -> torch.Tensor:
    """z = x / τ in the compute dtype, written into ``out`` unless ``x`` can be used as is.

    The returned tensor may alias ``x`` (compute dtype, τ = 1): callers never write into it.
    """
    if x.dtype == cdt and temperature == 1.0:
        return x
    out.copy_(x)
    return out if temperature == 1.0 else out.div_(temperature)


def _local_ids(ids: torch.Tensor, offset: int, vocab_shard: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Map global ids to (clamped local index, owned-by-this-rank mask)."""
    local = ids - offset
    owned = (local >= 0) & (local < vocab_shard)
    return local.clamp(0, vocab_shard - 1), owned


def _local_topk(z: torch.Tensor, k: int, flags: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of each row of ``z`` [R, V/P] with ties at the k-th value broken towards the lower index.

    ``torch.topk`` picks arbitrarily among values equal to the k-th largest; only rows where such a tie
    straddles the boundary (more than k values ≥ the k-th) are redone with a stable sort. ``flags`` is
    a bool work buffer shaped like ``z``.
    """
    vals, idx = z.topk(k, dim=-1, sorted=False)
    kth = vals.min(dim=-1, keepdim=True).values
    tied = torch.ge(z, kth, out=flags).sum(dim=-1) > k
    if bool(tied.any()):
        rows = tied.nonzero().squeeze(1)
        svals, sidx = torch.sort(z[rows], dim=-1, descending=True, stable=True)
        vals[rows] = svals[:, :k]
        idx[rows] = sidx[:, :k]
    return vals, idx


def _order_candidates(vals: torch.Tensor, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep the k best of [N, M] candidates, ordered by value descending, then global id ascending."""
    by_id = ids.argsort(dim=-1, stable=True)
    vals, ids = vals.gather(1, by_id), ids.gather(1, by_id)
    by_val = vals.argsort(dim=-1, descending=True, stable=True)[:, :k]
    return vals.gather(1, by_val), ids.gather(1, by_val)


class LogitsSource(Protocol):
    """Where a chunk of logits comes from: a logits shard (``Logits``) or the output layer applied chunk by
    chunk (``ops/fused_output.py``). ``rows`` × ``vocab_shard`` is the logits' shape; ``dtype`` theirs."""

    rows: int
    vocab_shard: int
    dtype: torch.dtype
    device: torch.device

    def chunk(self, a: int, b: int, cdt: torch.dtype, temperature: float, out: torch.Tensor) -> torch.Tensor:
        """z = logits[a:b] / τ in ``cdt``, written into ``out`` [b − a, V/P] unless it can alias the input."""
        ...


class UnappliedOutput(Protocol):
    """Logits given as the layer that makes them (``ops.fused_output.OutputShard``): ``token_stats`` hands
    it the flattened request and it returns (logp, topk_logp, topk_ids, entropy) as the kernel does."""

    @property
    def rows_shape(self) -> torch.Size: ...
    @property
    def vocab_shard(self) -> int: ...
    @property
    def device(self) -> torch.device: ...

    def stats(
        self,
        ids: torch.Tensor,
        k: int,
        topk_rows: torch.Tensor | None,
        group: dist.ProcessGroup | None,
        temperature: float,
        with_entropy: bool,
        chunk_tokens: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]: ...


class Logits:
    """A materialised logits shard ``[N, V/P]`` as a ``LogitsSource`` (today's path)."""

    def __init__(self, x: torch.Tensor):
        self.x = x
        self.rows, self.vocab_shard = x.shape
        self.dtype, self.device = x.dtype, x.device

    def chunk(self, a: int, b: int, cdt: torch.dtype, temperature: float, out: torch.Tensor) -> torch.Tensor:
        return _scaled(self.x[a:b], cdt, temperature, out)


def _forward_stats(
    src: LogitsSource,
    ids: torch.Tensor,
    k: int,
    topk_rows: torch.Tensor | None,
    group: dist.ProcessGroup | None,
    temperature: float,
    with_entropy: bool,
    chunk: int,
) -> tuple[torch.Tensor, ...]:
    """Chunked forward over the logits of ``src`` [N, V/P] and global ``ids`` [N, J].

    Returns (lse [N], logp at ids [N, J], topk logp [N, k], topk ids [N, k], entropy [N] or empty),
    all in the compute dtype except the int64 ids.
    """
    n, vs = src.rows, src.vocab_shard
    cdt = _compute_dtype(src.dtype)
    rank, world = _group_rank_size(group)
    offset = rank * vs
    j = ids.shape[1]
    # Per-row local statistics, relative to the local max so exp() never overflows.
    dev = src.device
    m_loc = torch.empty(n, dtype=cdt, device=dev)
    s_loc = torch.empty(n, dtype=cdt, device=dev)
    sd_loc = torch.zeros(
        n, dtype=cdt, device=dev
    )  # Σ exp(z − m)·(z − m): entropy without cancellation against lse
    z_ids = torch.zeros(n, j, dtype=cdt, device=dev)
    kl = min(k, vs)
    cand_v = torch.full((n, kl), -torch.inf, dtype=cdt, device=dev)
    cand_i = torch.zeros((n, kl), dtype=torch.int64, device=dev)
    local_ids, owned = _local_ids(ids, offset, vs)
    ws = _Workspace(min(chunk, n), vs, cdt, 3, dev)
    flags = torch.empty(min(chunk, n), vs, dtype=torch.bool, device=dev) if kl else None
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        r = b - a
        z = src.chunk(a, b, cdt, temperature, ws.get(0, r))
        m = torch.amax(z, dim=-1)
        d = torch.sub(z, m[:, None], out=ws.get(1, r))
        m_loc[a:b] = m
        if with_entropy:
            e = torch.exp(d, out=ws.get(2, r))
            torch.sum(e, dim=-1, out=s_loc[a:b])
            sd_loc[a:b] = torch.bmm(e.unsqueeze(1), d.unsqueeze(2)).view(-1)
        else:
            torch.sum(d.exp_(), dim=-1, out=s_loc[a:b])
        if j:
            z_ids[a:b] = torch.where(owned[a:b], z.gather(1, local_ids[a:b]), 0)
        if kl:
            assert flags is not None  # allocated above whenever kl > 0
            rows = None if topk_rows is None else topk_rows[a:b].nonzero().squeeze(1)
            if rows is None:
                v, i = _local_topk(z, kl, flags[:r])
                cand_v[a:b], cand_i[a:b] = v, i + offset
            elif rows.numel():
                v, i = _local_topk(z[rows], kl, flags[: rows.numel()])
                cand_v[a + rows], cand_i[a + rows] = v, i + offset
    # Drop the last chunk's views before the collectives: a fused source frees its GEMM block with them.
    z = d = e = None  # type: ignore[assignment]
    if world > 1:
        m_glob = m_loc.clone()
        dist.all_reduce(m_glob, op=dist.ReduceOp.MAX, group=group)
        scale = (m_loc - m_glob).exp()
        # Σ e^{z−M}(z−M) = scale·(Σ e^{z−m}(z−m) + (m − M)·Σ e^{z−m}) for the global max M.
        packed = torch.cat(
            [(s_loc * scale)[:, None], (scale * (sd_loc + (m_loc - m_glob) * s_loc))[:, None], z_ids], dim=1
        )
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
        s_glob, sd_glob, z_ids = packed[:, 0], packed[:, 1], packed[:, 2:]
    else:
        m_glob, s_glob, sd_glob = m_loc, s_loc, sd_loc
    log_s = s_glob.log()
    lse = m_glob + log_s
    logp = z_ids - lse[:, None]
    entropy = (log_s - sd_glob / s_glob) if with_entropy else torch.empty(0, dtype=cdt, device=dev)
    if k:
        if world > 1:
            all_v = [torch.empty_like(cand_v) for _ in range(world)]
            all_i = [torch.empty_like(cand_i) for _ in range(world)]
            dist.all_gather(all_v, cand_v, group=group)
            dist.all_gather(all_i, cand_i, group=group)
            cand_v, cand_i = torch.cat(all_v, dim=1), torch.cat(all_i, dim=1)
            del all_v, all_i  # the gathered copies are dead once concatenated
        top_v, top_i = _order_candidates(cand_v, cand_i, k)
        topk_logp = top_v - lse[:, None]
    else:
        topk_logp = torch.empty(n, 0, dtype=cdt, device=dev)
        top_i = torch.empty(n, 0, dtype=torch.int64, device=dev)
    return lse, logp, topk_logp, top_i, entropy


def backward_chunks(
    src: LogitsSource,
    ids: torch.Tensor | None,
    grad_ids: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    rank: int,
    temperature: float,
    chunk: int,
    out: torch.Tensor | None = None,
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Yield ``(a, b, ∂L/∂logits[a:b])`` chunk by chunk, recomputing p = softmax(z) per chunk.

    With g_j = ∂L/∂log p(id_j) and g_H = ∂L/∂H:
    ∂L/∂z_v = Σ_j g_j·1[v = id_j] − p_v·(Σ_j g_j + g_H·(log p_v + H)), and ∂L/∂x = ∂L/∂z / τ.
    Each yielded chunk is in the compute dtype and lives in a work buffer (valid until the next chunk), or
    in ``out[a:b]`` when ``out`` (an [N, V/P] tensor of the compute dtype) is given.
    """
    n, vs = src.rows, src.vocab_shard
    cdt = lse.dtype
    inv_t = 1.0 / temperature
    # ∂L/∂x_v = p_v·(α·log p_v + β) + Σ_j (g_j / τ)·1[v = id_j] with per-row α = −g_H/τ and
    # β = −(Σ_j g_j + g_H·H)/τ: two multiplies per element after the exp.
    g_sum = grad_ids.sum(dim=1) if grad_ids is not None else torch.zeros(n, dtype=cdt, device=src.device)
    beta = -inv_t * g_sum
    if grad_entropy is not None:
        alpha = -inv_t * grad_entropy
        beta = beta - inv_t * grad_entropy * entropy
    if grad_ids is not None:
        assert ids is not None  # the backward passes ids and their gradients together
        local_ids, owned = _local_ids(ids, rank * vs, vs)
        g_owned = torch.where(owned, grad_ids * inv_t, 0)
    ws = _Workspace(min(chunk, n), vs, cdt, 3, src.device)
    for a in range(0, n, chunk):
        b = min(n, a + chunk)
        r = b - a
        z = src.chunk(a, b, cdt, temperature, ws.get(0, r))
        logp = torch.sub(z, lse[a:b, None], out=ws.get(1, r))
        target = out[a:b] if out is not None else ws.get(0, r)  # z is dead once logp exists
        if grad_entropy is not None:
            p = torch.exp(logp, out=ws.get(2, r))
            coef = logp.mul_(alpha[a:b, None]).add_(beta[a:b, None])
            torch.mul(p, coef, out=target)
        else:
            torch.mul(logp.exp_(), beta[a:b, None], out=target)
        if grad_ids is not None:
            target.scatter_add_(1, local_ids[a:b], g_owned[a:b])
        yield a, b, target


def _backward_stats(
    x: torch.Tensor,
    ids: torch.Tensor | None,
    grad_ids: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    rank: int,
    temperature: float,
    chunk: int,
) -> torch.Tensor:
    """Gradient w.r.t. the shard ``x`` [N, V/P] (``backward_chunks`` over a materialised shard)."""
    grad = torch.empty_like(x)
    direct = grad.dtype == lse.dtype  # write straight into the gradient, no staging copy
    src = Logits(x)
    for a, b, g in backward_chunks(
        src, ids, grad_ids, grad_entropy, lse, entropy, rank, temperature, chunk, grad if direct else None
    ):
        if not direct:
            grad[a:b].copy_(g)
    return grad


def grad_inputs(
    ids: torch.Tensor, topk_ids: torch.Tensor, g_logp, g_topk, g_ent, ent: torch.Tensor, cdt: torch.dtype
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """The ids and ∂L/∂log p at them (requested ids, then the top-k) and ∂L/∂H that reach a backward."""
    id_parts, grad_parts = [], []
    if g_logp is not None and ids.shape[1]:
        id_parts.append(ids)
        grad_parts.append(g_logp)
    if g_topk is not None and topk_ids.shape[1]:
        id_parts.append(topk_ids)
        grad_parts.append(g_topk)
    all_ids = torch.cat(id_parts, dim=1) if id_parts else None
    all_g = torch.cat(grad_parts, dim=1).to(cdt) if grad_parts else None
    g_ent = g_ent.to(cdt) if g_ent is not None and ent.numel() else None
    return all_ids, all_g, g_ent


class _VocabParallelStats(torch.autograd.Function):
    """One pass over a logits shard: log p at ids, global top-k, entropy (see ``token_stats``)."""

    @staticmethod
    def forward(ctx, logits, ids, k, topk_rows, group, temperature, with_entropy, chunk_tokens):
        vs = logits.shape[-1]
        x = logits.reshape(-1, vs)
        chunk = _chunk_rows(vs, chunk_tokens, logits.device)
        lse, logp, topk_logp, topk_ids, ent = _forward_stats(
            Logits(x), ids, k, topk_rows, group, temperature, with_entropy, chunk
        )
        ctx.save_for_backward(logits, ids, topk_ids, lse, ent)
        ctx.group, ctx.temperature, ctx.chunk = group, temperature, chunk
        ctx.mark_non_differentiable(topk_ids)
        ctx.set_materialize_grads(False)
        return logp, topk_logp, topk_ids, ent

    @staticmethod
    def backward(ctx, g_logp, g_topk, _g_ids, g_ent):
        logits, ids, topk_ids, lse, ent = ctx.saved_tensors
        all_ids, all_g, g_ent = grad_inputs(ids, topk_ids, g_logp, g_topk, g_ent, ent, lse.dtype)
        if all_g is None and g_ent is None:
            return (None,) * 8
        vs = logits.shape[-1]
        rank, _ = _group_rank_size(ctx.group)
        grad = _backward_stats(
            logits.reshape(-1, vs), all_ids, all_g, g_ent, lse, ent, rank, ctx.temperature, ctx.chunk
        )
        return grad.view(logits.shape), None, None, None, None, None, None, None


def token_stats(
    logits: torch.Tensor | UnappliedOutput,
    ids: torch.Tensor | None = None,
    *,
    k: int = 0,
    topk_rows: torch.Tensor | None = None,
    with_entropy: bool = False,
    group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
) -> VocabStats:
    """Fused single pass: log p at ``ids``, the global top-``k`` and the entropy, differentiable.

    logits:    [..., V/P] local shard (any leading shape, flattened to N rows), or the output layer not
               yet applied (``ops.fused_output.OutputShard``: no logits tensor is ever built)
    ids:       [..., J] global vocabulary ids per row, or None
    k:         top-k size (0 = none); ``topk_rows`` [...] bool restricts it to some rows (others: ids 0,
               log-probs −inf)
    Returns ``VocabStats`` with rows flattened: logp [N, J], topk_logp [N, k], topk_ids [N, k],
    entropy [N] (empty unless ``with_entropy``). Gradients flow through logp, topk_logp and entropy.
    """
    unapplied = None if isinstance(logits, torch.Tensor) else logits  # an output layer (fused_output.py)
    if unapplied is None:
        assert isinstance(logits, torch.Tensor)
        vs, lead = logits.shape[-1], logits.shape[:-1]
    else:
        vs, lead = unapplied.vocab_shard, unapplied.rows_shape
    n = lead.numel()
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    _, world = _group_rank_size(group)
    if k > vs * world:
        raise ValueError(f"top-k of {k} ids asked from a vocabulary of {vs * world}; use k <= vocab size")
    if ids is None:
        ids2 = torch.empty(n, 0, dtype=torch.int64, device=logits.device)
    else:
        if ids.shape[: len(lead)] != lead:
            raise ValueError(
                f"ids {tuple(ids.shape)} must start with the logits' leading shape {tuple(lead)}"
            )
        ids2 = ids.reshape(n, -1).long()
        if ids2.numel():  # out-of-range ids only miss every shard's mask on device: no wrong index
            check(
                (ids2.min() < 0) | (ids2.max() >= vs * world),
                f"ids must lie in [0, {vs * world}) (the padded vocabulary), got an id outside it",
            )
    rows = None if topk_rows is None else topk_rows.reshape(n).bool()
    args = (ids2, int(k), rows, group, float(temperature), bool(with_entropy), chunk_tokens)
    if unapplied is not None:
        logp, topk_logp, topk_ids, ent = unapplied.stats(*args)
    else:
        logp, topk_logp, topk_ids, ent = _VocabParallelStats.apply(logits, *args)
    if rows is not None and k:
        # Rows without a top-k request carry placeholders; make them unmistakable (and gradient-free).
        topk_logp = torch.where(rows[:, None], topk_logp, -torch.inf)
        topk_ids = torch.where(rows[:, None], topk_ids, 0)
    return VocabStats(logp, topk_logp, topk_ids, ent)


def log_probs(
    logits: torch.Tensor,
    ids: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """log softmax(logits / τ) at global ``ids``.

    logits [..., V/P] with ids [...] → [...], or ids [..., K] → [..., K].
    """
    lead = logits.shape[:-1]
    if ids.dim() == len(lead):
        logp = token_stats(
            logits, ids.unsqueeze(-1), group=group, temperature=temperature, chunk_tokens=chunk_tokens
        )
        return logp.logp.view(lead)
    out = token_stats(logits, ids, group=group, temperature=temperature, chunk_tokens=chunk_tokens).logp
    return out.view(*lead, ids.shape[-1])


def entropy(
    logits: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """Full-vocabulary entropy −Σ p log p of softmax(logits / τ): logits [..., V/P] → [...]."""
    out = token_stats(
        logits, None, with_entropy=True, group=group, temperature=temperature, chunk_tokens=chunk_tokens
    )
    return out.entropy.view(logits.shape[:-1])


def top_k(
    logits: torch.Tensor,
    k: int,
    group: dist.ProcessGroup | None = None,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Global top-k of softmax(logits / τ): (log-probs [..., k] descending, global ids [..., k]).

    Log-probs are exact full-vocabulary values (differentiable); ids are constants; equal values are
    ordered by ascending global id.
    """
    out = token_stats(logits, None, k=k, group=group, temperature=temperature, chunk_tokens=chunk_tokens)
    lead = logits.shape[:-1]
    return out.topk_logp.view(*lead, k), out.topk_ids.view(*lead, k)


def append_tail(logp: torch.Tensor, min_tail: float = 1e-30) -> torch.Tensor:
    """Add the tail bucket log(1 − Σ_K p) to top-K log-probs: [..., K] → [..., K+1] (differentiable).

    ``min_tail`` floors 1 − Σ p (reached when the K ids hold all the mass, or by rounding) so that the
    bucket stays finite; the floored value carries no gradient.
    """
    mass = torch.logsumexp(logp, dim=-1, keepdim=True)
    tail = (-torch.expm1(mass)).clamp_min(min_tail).log()
    return torch.cat([logp, tail], dim=-1)
