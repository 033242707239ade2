"""The DeepSeek-V3 Multi-head Latent Attention rows of the conversion table (``conversion/table.py``).

HF (``DeepseekV3Attention``) and megatron (``MLASelfAttention``, local spec) lay MLA's weights out alike:

=============================================  ===========================================  ==========
HF ``model.layers.{i}.self_attn.``              megatron ``decoder.layers.{i}.self_attention.``  TP
=============================================  ===========================================  ==========
``q_a_proj.weight`` ``[q_lora, H]``              ``linear_q_down_proj.weight``                 column
``q_a_layernorm.weight`` ``[q_lora]``            ``q_layernorm.weight``                        replicated
``q_b_proj.weight`` ``[n*(nope+rope), q_lora]``  ``linear_q_up_proj.weight``                   column
``q_proj.weight`` (``q_lora_rank`` None)         ``linear_q_proj.weight``                      column
``kv_a_proj_with_mqa.weight`` ``[kv_lora+rope, H]``  ``linear_kv_down_proj.weight``            column
``kv_a_layernorm.weight`` ``[kv_lora]``          ``kv_layernorm.weight``                       replicated
``kv_b_proj.weight`` ``[n*(nope+v), kv_lora]``   ``linear_kv_up_proj.weight``                  column
``o_proj.weight`` ``[H, n*v]``                   ``linear_proj.weight``                        row
=============================================  ===========================================  ==========

q rows are per head ``[nope | rope]`` on both sides, kv_a rows ``[latent | rope]``, kv_b rows per head
``[k_nope | v]`` (megatron splits ``linear_kv_up_proj``'s output per head into ``qk_head_dim`` then
``v_head_dim``, as HF's ``expand_kv`` splits ``kv_b_proj``'s), so ``kv_b_proj`` maps one to one. The local
spec's down projections are ``ColumnParallelLinear`` (output gathered inside MLA): column-split over TP; the
policy's TE spec uses ``TEColumnParallelLinear`` there too (``models/mla.py``), not TE's duplicated default.

RoPE layout: megatron's MLA RoPE de-interleaves the RoPE dims (evens, then odds) before rotating halves,
which is HF's ``rope_interleave=True``: identity. For ``rope_interleave=False`` HF rotates the stored halves,
so the RoPE rows of q (per head) and of kv_a are interleaved on import (``[h0, h_{d/2}, h1, h_{d/2+1}, ..]``)
and de-interleaved on export; q and k are permuted alike, so their dot products are unchanged.
"""

from __future__ import annotations

import torch

from srpo_megatron.models.architecture import Architecture


def _interleave(d: int) -> torch.Tensor:
    """Megatron RoPE row ``r`` takes HF row ``perm[r]`` (HF halves -> megatron interleaved pairs)."""
    half = torch.arange(d // 2)
    return torch.stack([half, half + d // 2], dim=1).reshape(-1)


def _permute_rope(t: torch.Tensor, arch: Architecture, per_head: bool, inverse: bool) -> torch.Tensor:
    if arch.rope_interleave:
        return t
    d = arch.qk_rope_head_dim
    perm = _interleave(d)
    if inverse:
        perm = torch.argsort(perm)
    rest = t.shape[1:]
    if per_head:  # [n * (nope + rope), ...]
        t = t.reshape(arch.num_heads, arch.qk_nope_head_dim + d, *rest)
        nope, rope = t.split([arch.qk_nope_head_dim, d], dim=1)
        return torch.cat([nope, rope[:, perm.to(t.device)]], dim=1).reshape(-1, *rest)
    latent, rope = t.split([arch.kv_lora_rank, d], dim=0)  # [kv_lora + rope, ...]
    return torch.cat([latent, rope[perm.to(t.device)]], dim=0)


def q_rope_in(arch: Architecture, ts: list[torch.Tensor], tp: int) -> torch.Tensor:
    """HF ``q_b_proj`` / ``q_proj`` -> megatron ``linear_q_up_proj`` / ``linear_q_proj``."""
    return _permute_rope(ts[0], arch, per_head=True, inverse=False)


def q_rope_out(arch: Architecture, t: torch.Tensor) -> list[torch.Tensor]:
    return [_permute_rope(t, arch, per_head=True, inverse=True).contiguous()]


def kv_a_rope_in(arch: Architecture, ts: list[torch.Tensor], tp: int) -> torch.Tensor:
    """HF ``kv_a_proj_with_mqa`` -> megatron ``linear_kv_down_proj``."""
    return _permute_rope(ts[0], arch, per_head=False, inverse=False)


def kv_a_rope_out(arch: Architecture, t: torch.Tensor) -> list[torch.Tensor]:
    return [_permute_rope(t, arch, per_head=False, inverse=True).contiguous()]


def q_rope_pieces(arch: Architecture, ts: list[torch.Tensor], tp: int) -> list[torch.Tensor]:
    return [q_rope_in(arch, ts, tp)]


def kv_a_rope_pieces(arch: Architecture, ts: list[torch.Tensor], tp: int) -> list[torch.Tensor]:
    return [kv_a_rope_in(arch, ts, tp)]


def mla_full_shape(arch: Architecture, name: str) -> tuple[int, ...] | None:
    """Full megatron shape of an MLA attention parameter ``name`` (None: not an MLA attention parameter)."""
    a, h = arch, arch.hidden_size
    q_head = a.qk_nope_head_dim + a.qk_rope_head_dim
    shapes = {
        "self_attention.linear_q_down_proj.weight": (a.q_lora_rank, h),
        "self_attention.q_layernorm.weight": (a.q_lora_rank,),
        "self_attention.linear_q_up_proj.weight": (a.num_heads * q_head, a.q_lora_rank),
        "self_attention.linear_q_proj.weight": (a.num_heads * q_head, h),
        "self_attention.linear_kv_down_proj.weight": (a.kv_lora_rank + a.qk_rope_head_dim, h),
        "self_attention.kv_layernorm.weight": (a.kv_lora_rank,),
        "self_attention.linear_kv_up_proj.weight": (
            a.num_heads * (a.qk_nope_head_dim + a.v_head_dim),
            a.kv_lora_rank,
        ),
        "self_attention.linear_proj.weight": (h, a.num_heads * a.v_head_dim),
    }
    for suffix, shape in shapes.items():
        if name.endswith(suffix):
            return shape
    return None
