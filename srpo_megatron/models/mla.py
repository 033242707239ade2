"""Multi-head Latent Attention (DeepSeek-V3/R1) in the policy: megatron-core's MLA config and layer spec.

``mla_transformer_config`` turns the policy's TransformerConfig fields into megatron's
``MLATransformerConfig`` (q/kv LoRA ranks, the q/k head split into ``qk_head_dim`` (no RoPE) and
``qk_pos_emb_head_dim`` (RoPE), ``v_head_dim``, YaRN). ``with_mla_attention`` puts megatron's
``MLASelfAttention`` (local spec: :class:`SDPACoreAttention` in the ``core_attention`` slot, whose output
width follows MLA's ``v_channels``) into a layer spec whose MLP part was built as for any architecture
(dense or MoE per layer). :class:`MLASelfAttentionWholeKVDown` fixes megatron's gradient of the shared
RoPE key under TP (megatron-core 0.16.1 to 0.19.2 miss the other ranks' heads).

What was checked against transformers' ``DeepseekV3Attention`` (the tests compare logits and gradients):
- Layout. megatron's ``linear_q_up_proj`` (or ``linear_q_proj``) and HF's ``q_b_proj`` (``q_proj``) are
  per head ``[nope | rope]``; ``linear_kv_down_proj`` and ``kv_a_proj_with_mqa`` are ``[latent | rope]``;
  ``linear_kv_up_proj`` and ``kv_b_proj`` are per head ``[k_nope | v]``. The rows map one to one.
- RoPE. megatron's MLA RoPE (``rope_utils._apply_rotary_pos_emb_bshd`` with ``multi_latent_attention``)
  first de-interleaves the RoPE dims (evens, then odds) and then rotates halves: exactly HF's
  ``rope_interleave=True`` (``apply_rotary_pos_emb_interleave``). HF's ``rope_interleave=False`` rotates the
  stored halves directly; the conversion table then interleaves the RoPE rows of the q and kv_a projections
  (``conversion/mla_rows.py``), so megatron's de-interleave gives back HF's halves.
- YaRN. megatron's ``YarnRotaryEmbedding`` computes HF's inverse frequencies (same ramp, same correction
  range rounded to integers: HF's ``truncate=True``, the only value MLA's megatron accepts) and multiplies
  cos/sin by ``m(f, mscale) / m(f, mscale_all_dim)``; HF multiplies them by ``attention_factor``, the same
  ratio when both mscales are set and ``m(f)`` otherwise. megatron's MLA softmax scale is
  ``m(f, mscale_all_dim)**2 / sqrt(q_head_dim)``, HF's ``yarn_apply_mscale`` the same (1 when
  ``mscale_all_dim`` is unset or 0). So megatron's ``mscale`` is chosen to give HF's attention factor
  (``_megatron_mscale``) and ``mscale_all_dim`` is passed as is (0 when unset).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.mappings import (
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_config import MLATransformerConfig

from srpo_megatron.models.architecture import Architecture, UnsupportedModelError


def _m(factor: float, mscale: float = 1.0) -> float:
    """YaRN's ``get_mscale`` (HF and megatron alike)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _megatron_mscale(arch: Architecture) -> float:
    """megatron ``mscale`` whose ``m(f, mscale) / m(f, mscale_all_dim)`` is HF's YaRN attention factor."""
    yarn = arch.yarn
    assert yarn is not None
    if yarn.mscale and yarn.mscale_all_dim:
        return yarn.mscale  # the same ratio on both sides
    if yarn.factor <= 1:
        return 1.0  # every m() is 1
    # HF: m(f); solve 0.1 * ms * ln f + 1 = m(f) * m(f, all) for ms
    return (yarn.attention_factor() * _m(yarn.factor, yarn.mscale_all_dim or 0.0) - 1.0) / (
        0.1 * math.log(yarn.factor)
    )


def mla_transformer_config(arch: Architecture, fields: dict[str, Any]) -> MLATransformerConfig:
    """megatron's ``MLATransformerConfig`` from the policy's TransformerConfig ``fields`` plus MLA's own."""
    rope: dict[str, Any]
    if arch.rope_type == "yarn":
        yarn = arch.yarn
        assert yarn is not None
        if not yarn.truncate:
            raise UnsupportedModelError(
                "deepseek_v3 YaRN with truncate=false is not supported: megatron's MLA rounds the YaRN "
                "correction range to integers (HF's truncate=true, what DeepSeek-V3 ships)"
            )
        rope = dict(
            rope_type="yarn",
            rotary_scaling_factor=yarn.factor,
            original_max_position_embeddings=yarn.original_max_position_embeddings,
            beta_fast=yarn.beta_fast,
            beta_slow=yarn.beta_slow,
            mscale=_megatron_mscale(arch),
            mscale_all_dim=yarn.mscale_all_dim or 0.0,
        )
    elif arch.rope_type == "default":
        # rotary_scaling_factor 1 and mscale_all_dim 0: megatron's MLA softmax scale is 1/sqrt(q_head_dim);
        # megatron fuses MLA's RoPE only for YaRN (MLATransformerConfig refuses it otherwise)
        rope = dict(rope_type="rope", rotary_scaling_factor=1.0, mscale=1.0, mscale_all_dim=0.0)
        fields = {**fields, "apply_rope_fusion": False}
    else:
        raise UnsupportedModelError(
            f"deepseek_v3 with rope scaling {arch.rope_type!r} is not supported; megatron's MLA has "
            "'default' RoPE and 'yarn'"
        )
    return MLATransformerConfig(
        **fields,
        q_lora_rank=arch.q_lora_rank,
        kv_lora_rank=arch.kv_lora_rank,
        qk_head_dim=arch.qk_nope_head_dim,
        qk_pos_emb_head_dim=arch.qk_rope_head_dim,
        v_head_dim=arch.v_head_dim,
        rotary_base=arch.rope_theta,
        **rope,
    )


class _AllReduceRopeGrad(torch.autograd.Function):
    """Identity forward; backward sums the last ``rope`` columns of the gradient over the TP group."""

    @staticmethod
    def forward(ctx, kv: torch.Tensor, rope: int, group) -> torch.Tensor:
        ctx.rope, ctx.group = rope, group
        return kv

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        part = grad[..., -ctx.rope :].contiguous()
        dist.all_reduce(part, group=ctx.group)
        grad[..., -ctx.rope :] = part
        return grad, None, None


class MLASelfAttentionWholeKVDown(MLASelfAttention):
    """megatron's ``MLASelfAttention`` whose column-parallel kv down projection returns its output whole, so
    that the shared RoPE key gets the gradient of every head (same parameters, names and forward maths).

    Under TP each rank attends with its own heads, but the RoPE key ``k_pos_emb`` (the last
    ``qk_pos_emb_head_dim`` outputs of ``linear_kv_down_proj``) is shared by all heads. With a column-parallel
    down projection megatron-core's MLA (0.16.1 to 0.19.2) gathers the shards itself and splits the gradient
    back without summing it over TP, so ``k_pos_emb``'s gradient holds only the rank's own heads (the latent
    part is right: ``linear_kv_up_proj`` all-reduces its input gradient). Returned whole, MLA takes its
    "duplicated" path: without sequence parallelism the RoPE columns' gradient is summed over TP here; with
    it, the output is scattered to this rank's tokens and MLA's ``gather_from_sequence_parallel_region`` of
    ``k_pos_emb`` sums it over TP (reduce-scatter) in backward."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        linear = self.linear_kv_down_proj
        forward, group, rope = linear.forward, self.tp_group, self.config.qk_pos_emb_head_dim

        def whole(input_: torch.Tensor, *a: Any, **kw: Any):
            out, bias = forward(input_, *a, **kw)
            if dist.get_world_size(group) == 1:
                return out, bias
            out = gather_from_tensor_model_parallel_region(out, group=group)
            if self.config.sequence_parallel:
                return scatter_to_sequence_parallel_region(out, group=group), bias
            return _AllReduceRopeGrad.apply(out, rope, group), bias

        linear.forward = whole

    def _resolve_qk_norm_config(self, submodules) -> dict[str, Any]:
        """megatron-core >= 0.19 (0.16.1 has no such hook): the spec's projections and latent norms as given.

        megatron's resolver (``mla_qk_norm_config``) ties the latent norms to ``config.qk_layernorm``: off, it
        refuses ``kv_layernorm``; on, it wants a fused norm+linear ``linear_q_proj`` without q compression
        (a norm HF's ``q_proj`` does not have, and that the local spec cannot build), and
        ``finalize_model_grads`` then sums the replicated ``q_layernorm`` gradient over TP, which is already
        whole without sequence parallelism. HF's MLA has exactly ``q_a_layernorm`` (with q compression) and
        ``kv_a_layernorm``, which is what the policy's spec says."""
        from megatron.core.transformer.identity_op import IdentityOp

        return dict(
            linear_q_proj=submodules.linear_q_proj,
            linear_q_up_proj=submodules.linear_q_up_proj,
            linear_kv_up_proj=submodules.linear_kv_up_proj,
            q_layernorm=submodules.q_layernorm if self.config.q_lora_rank is not None else IdentityOp,
            kv_layernorm=submodules.kv_layernorm,
        )


def with_mla_attention(spec: ModuleSpec, *, use_te: bool, sequence_parallel: bool) -> ModuleSpec:
    """``spec`` (a layer spec built for the MLP) with megatron's MLA self-attention and its input norm.

    The attention part (and the layer's input norm and checkpoint key map, which depend on whether the
    attention fuses the norm) comes from megatron's own MLA spec, as :class:`MLASelfAttentionWholeKVDown`
    with column-parallel down projections; on the local spec the core attention is
    :class:`SDPACoreAttention` and, under sequence parallelism, every norm is SP-aware (the local torch norm
    refuses SP): ``q_layernorm`` / ``kv_layernorm`` normalise the latents of this rank's tokens."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from srpo_megatron.models.attention import SDPACoreAttention
    from srpo_megatron.models.norms import SequenceParallelRMSNorm

    if use_te:
        from megatron.core.extensions.transformer_engine import TEColumnParallelLinear
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        mla = get_gpt_layer_with_transformer_engine_spec(multi_latent_attention=True, qk_layernorm=True)
        attention = mla.submodules.self_attention
        # TE's MLA spec has duplicated (replicated) down projections; column-parallel ones, as on the local
        # spec, keep one TP layout for the conversion table (conversion/mla_rows.py). Not verified on a GPU.
        down = dict(linear_q_down_proj=TEColumnParallelLinear, linear_kv_down_proj=TEColumnParallelLinear)
        attention = dataclasses.replace(
            attention,
            module=MLASelfAttentionWholeKVDown,
            submodules=dataclasses.replace(attention.submodules, **down),
        )
    else:
        from srpo_megatron.compat.cpu import mark_te_absent_for_mla

        mark_te_absent_for_mla()
        mla = get_gpt_layer_local_spec(
            multi_latent_attention=True, qk_layernorm=True, normalization="RMSNorm"
        )
        attention = mla.submodules.self_attention
        parts: dict[str, Any] = dict(core_attention=SDPACoreAttention)
        if sequence_parallel:
            parts.update(q_layernorm=SequenceParallelRMSNorm, kv_layernorm=SequenceParallelRMSNorm)
        attention = dataclasses.replace(
            attention,
            module=MLASelfAttentionWholeKVDown,
            submodules=dataclasses.replace(attention.submodules, **parts),
        )
    layer = dataclasses.replace(
        spec.submodules,
        self_attention=attention,
        # TE fuses the input norm into linear_qkv, which MLA has not; the local spec's is already SP-aware
        input_layernorm=mla.submodules.input_layernorm if use_te else spec.submodules.input_layernorm,
        sharded_state_dict_keys_map={
            k: v
            for k, v in spec.submodules.sharded_state_dict_keys_map.items()
            if not k.startswith("input_layernorm")
        },
    )
    return dataclasses.replace(spec, submodules=layer)
