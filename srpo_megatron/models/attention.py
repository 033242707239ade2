"""Core attention for megatron-core's local layer spec that runs anywhere torch runs (CPU included).

``SDPACoreAttention`` is a drop-in for the spec's ``core_attention`` slot (same constructor and forward
signature as ``megatron.core.transformer.dot_product_attention.DotProductAttention``). It calls
``torch.nn.functional.scaled_dot_product_attention`` with a causal mask and native GQA, so it needs no
CUDA buffers (megatron's DotProductAttention preallocates from ``torch.cuda.current_device()``) and no
materialised repeat of K/V heads. It has no parameters. Dropout is not supported (RL policies train
with attention dropout 0; the config loader rejects anything else).

Packed sequences (THD, ``packed_seq_params.qkv_format == "thd"``): megatron hands ``[t, heads, hn]``
tensors holding several sequences end to end, delimited by ``cu_seqlens_q_padded`` (or ``cu_seqlens_q``).
Attention is block-diagonal causal: each sequence attends only to its own earlier tokens. Tokens between
a sequence's real end and its padded end are padding; causality keeps them out of every real token's
context, so their (unused) outputs need no mask.

Context parallelism (``context_parallel_size`` > 1, THD only, as TE's attention on GPU): every packed
sequence of padded length L is split into 2·CP chunks of L/(2·CP) tokens, and CP rank r holds chunks r and
2·CP−1−r (megatron's load-balanced causal split; RoPE follows it in ``rope_utils``). This module gathers
K and V of the whole sequence across the CP group (a differentiable all-gather: gradients flow back to the
rank that owns each chunk) and attends each local query chunk to the keys at or before its global
position. That is the reference maths of ring attention, at the cost of materialising the full K/V, which
is fine for the CPU tests it exists for; GPU runs use TE's CP attention.

gpt-oss (``attention_sinks``, sliding windows): with ``config.softmax_type == "learnable"`` the module owns
megatron's ``softmax_offset`` parameter (one logit per local head, the name and TP split of megatron's and
TE's DotProductAttention, so checkpoints are interchangeable with TE on GPU): each softmax row gets an extra
logit ``softmax_offset[h]`` whose probability is dropped (HF gpt-oss ``sinks``). A layer is a sliding-window
layer by megatron's rule (``window_size`` + ``window_attn_skip_freq``, ``is_layer_window_attention`` on the
global 1-based layer number); ``window_size=(left, 0)`` lets a query attend the ``left + 1`` keys ending at
itself (HF's ``sliding_window = left + 1``). SDPA has neither, so these layers run the attention explicitly
(:func:`_explicit_attention`, fp32 softmax), on the padded, the packed THD and the CP paths alike; layers
without either keep SDPA.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import is_layer_window_attention, make_sharded_tensors_for_checkpoint
from megatron.core.utils import divide


class SDPACoreAttention(MegatronModule):
    """Causal GQA attention via SDPA. Shapes follow megatron: sequence-first, heads local to the TP rank."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        k_channels: int | None = None,
        v_channels: int | None = None,
    ):
        super().__init__(config=config)
        self.cp_group = (
            pg_collection.cp if pg_collection is not None and hasattr(pg_collection, "cp") else None
        )
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(
                f"SDPACoreAttention does not implement attention dropout (got {dropout}); set it to 0"
            )
        self.attn_mask_type = attn_mask_type
        # MLA (models/mla.py) passes its q/k head width and its narrower v head width, as to megatron's
        # DotProductAttention; the output holds v heads
        k_channels = k_channels or config.kv_channels
        v_channels = v_channels or config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(k_channels)
        tp = pg_collection.tp.size() if pg_collection is not None else config.tensor_model_parallel_size
        self.hidden_size_per_partition = divide(v_channels * config.num_attention_heads, tp)
        self.tp_group = pg_collection.tp if pg_collection is not None else None
        # Sliding window: keys [q - left, q] (megatron's/TE's window_size=(left, 0)); None = full causal.
        self.window_left: int | None = None
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            left, right = config.window_size
            if right != 0 or left < 0:
                raise ValueError(
                    "SDPACoreAttention supports causal windows window_size=(left>=0, 0); "
                    f"got {config.window_size}"
                )
            self.window_left = int(left)
        if config.softmax_type == "learnable":
            # megatron's name and shape (DotProductAttention / TEDotProductAttention): [np / TP]
            heads = divide(config.num_attention_heads, tp)
            self.softmax_offset = torch.nn.Parameter(torch.empty(heads, dtype=config.params_dtype))
            if config.perform_initialization:
                config.init_method(self.softmax_offset)
            else:
                torch.nn.init.zeros_(self.softmax_offset)
        elif config.softmax_type == "vanilla":
            self.softmax_offset = None
        else:
            raise ValueError(
                "SDPACoreAttention supports softmax_type 'vanilla' and 'learnable'; "
                f"got {config.softmax_type!r}"
            )

    @property
    def explicit(self) -> bool:
        """Whether this layer needs the explicit attention (sinks or a sliding window: SDPA has neither)."""
        return self.softmax_offset is not None or self.window_left is not None

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """The learnable ``softmax_offset`` split over TP on dim 0, as megatron's DotProductAttention."""
        state = self.state_dict(prefix="", keep_vars=True) if self.softmax_offset is not None else {}
        dp_cp = (metadata or {}).get("dp_cp_group")
        groups = dict(tp_group=self.tp_group, dp_cp_group=dp_cp) if dp_cp is not None else {}
        return make_sharded_tensors_for_checkpoint(
            state, prefix, {"softmax_offset": 0}, sharded_offsets, **groups
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        """query ``[sq, b, np, hn]``, key/value ``[sk, b, ng, hn]`` -> context ``[sq, b, np*hn]``.

        ``attention_mask`` follows megatron's convention (bool, True = masked out, ``[b, 1, sq, sk]``);
        when it is None the mask type decides (causal for decoder self-attention).
        """
        if attention_bias is not None:
            raise NotImplementedError("SDPACoreAttention does not support attention bias")
        if packed_seq_params is not None:
            return self._packed(query, key, value, packed_seq_params)
        if self.config.context_parallel_size != 1:
            raise ValueError(
                "SDPACoreAttention runs context parallelism only on packed (THD) sequences; pack the "
                "micro-batch (train.max_tokens_per_micro_batch) or set parallel.cp=1"
            )
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, hn]
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        mask = None if attention_mask is None else ~attention_mask
        causal = attention_mask is None and mask_type == AttnMaskType.causal
        if causal and q.size(2) != k.size(2):
            raise NotImplementedError("causal SDPA attention needs equal query and key lengths (no KV cache)")
        if self.explicit:
            pos = torch.arange(q.size(2), device=q.device)
            allowed = self._allowed(pos, pos, causal=mask_type == AttnMaskType.causal)
            if mask is not None:
                allowed = allowed & mask
            out = self._explicit(q, k, v, allowed)
        else:
            out = torch.nn.functional.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                is_causal=causal,
                scale=self.softmax_scale,
                enable_gqa=q.size(1) != k.size(1),
            )
        sq, b = query.size(0), query.size(1)
        return out.permute(2, 0, 1, 3).reshape(sq, b, self.hidden_size_per_partition)

    def _packed(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params) -> torch.Tensor:
        """THD: query ``[t, np, hn]``, key/value ``[t, ng, hn]`` (this CP rank's chunks) -> ``[t, np*hn]``."""
        if params.qkv_format != "thd":
            raise NotImplementedError(
                f"packed_seq_params.qkv_format={params.qkv_format!r}; only 'thd' is supported"
            )
        cu = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        bounds = cu.tolist()
        cp, rank, group = 1, 0, None
        if self.config.context_parallel_size != 1:
            group = params.cp_group or self.cp_group or parallel_state.get_context_parallel_group()
            cp, rank = dist.get_world_size(group), dist.get_rank(group)
        if cp > 1:
            key, value = (_gather_cp_sequences(t, bounds, cp, group) for t in (key, value))
        outs = []
        for start, end in itertools.pairwise(bounds):
            n = end - start  # the sequence's padded global length
            local = slice(start // cp, end // cp)
            q = query[local].permute(1, 0, 2)[None]  # [1, np, n/cp, hn]
            k = key[start:end].permute(1, 0, 2)[None]  # [1, ng, n, hn]
            v = value[start:end].permute(1, 0, 2)[None]
            mask = None
            keys = torch.arange(n, device=query.device)
            pos = (
                _cp_positions(n, cp, rank, device=query.device) if cp > 1 else keys
            )  # local queries' positions
            if self.explicit:
                out = self._explicit(q, k, v, self._allowed(pos, keys, causal=True))
            else:
                if cp > 1:
                    mask = pos[:, None] >= keys[None, :]
                out = torch.nn.functional.scaled_dot_product_attention(
                    q,
                    k,
                    v,
                    attn_mask=mask,
                    is_causal=mask is None,
                    scale=self.softmax_scale,
                    enable_gqa=q.size(1) != k.size(1),
                )
            outs.append(out[0].permute(1, 0, 2))
        out = torch.cat(outs) if outs else query.new_zeros(0, query.size(1), value.size(-1))
        # [t, np * v]: megatron-core >= 0.19's MLA pads v to the q/k head width for THD and trims after
        return out.reshape(out.size(0), out.size(1) * out.size(2))

    def _allowed(self, queries: torch.Tensor, keys: torch.Tensor, *, causal: bool) -> torch.Tensor:
        """Bool ``[sq, sk]``, True where query position ``queries[i]`` may attend key position ``keys[j]``."""
        rel = queries[:, None] - keys[None, :]  # how far back the key is
        allowed = rel >= 0 if causal else torch.ones_like(rel, dtype=torch.bool)
        if self.window_left is not None:
            allowed = allowed & (rel <= self.window_left)
        return allowed

    def _explicit(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor
    ) -> torch.Tensor:
        return _explicit_attention(q, k, v, allowed, self.softmax_scale, self.softmax_offset)


def _explicit_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """softmax(q k^T * scale, masked, with one extra sink logit per head) v, the sink's share dropped.

    q ``[b, np, sq, hn]``, k/v ``[b, ng, sk, hn]`` (query head h uses group h // (np/ng)), ``allowed``
    bool ``[sq, sk]`` or ``[b, 1, sq, sk]``, sinks ``[np]`` or None -> ``[b, np, sq, hn]``. The softmax
    runs in fp32 (HF's eager gpt-oss attention subtracts the row max first; softmax does too).
    """
    b, np_, sq, hn = q.shape
    ng = k.size(1)
    qg = q.reshape(b, ng, np_ // ng, sq, hn)
    scores = torch.matmul(qg, k[:, :, None].transpose(-1, -2)).float() * scale  # [b, ng, rep, sq, sk]
    scores = scores.reshape(b, np_, sq, -1)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sink = sinks.float().reshape(1, np_, 1, 1).expand(b, np_, sq, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    probs = probs.to(v.dtype).reshape(b, ng, np_ // ng, sq, -1)
    return torch.matmul(probs, v[:, :, None]).reshape(b, np_, sq, hn)


def _cp_positions(n: int, cp: int, rank: int, device: torch.device) -> torch.Tensor:
    """Global in-sequence positions ``[n/cp]`` held by CP ``rank``: chunks ``rank`` and ``2·cp−1−rank``."""
    c = n // (2 * cp)
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    second = torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c, device=device)
    return torch.cat([first, second])


def _gather_cp_sequences(local: torch.Tensor, bounds: list[int], cp: int, group) -> torch.Tensor:
    """This rank's ``[t/cp, ...]`` chunks -> every sequence whole, in global order ``[t, ...]``."""
    shards = _AllGather.apply(local, group)  # [cp, t/cp, ...]
    host = torch.device("cpu")  # index bookkeeping; the gather itself runs on the tensors' device
    source, target = [], []
    for start, end in itertools.pairwise(bounds):
        for r in range(cp):
            source.append(r * local.size(0) + start // cp + torch.arange((end - start) // cp))
            target.append(start + _cp_positions(end - start, cp, r, device=host))
    order = torch.empty(bounds[-1], dtype=torch.long)
    order[torch.cat(target)] = torch.cat(source)  # global position -> row of the stacked shards
    return shards.reshape(-1, *local.shape[1:]).index_select(0, order.to(local.device))


class _AllGather(torch.autograd.Function):
    """All-gather along a new leading dim; backward sums the gradient over the group and keeps this rank's."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad[dist.get_rank(ctx.group)], None
