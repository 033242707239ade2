"""Mixture-of-Experts policies (Qwen3-MoE, GLM-4.5, DeepSeek-V3): the recipe's router controls and
megatron's MoE settings.

``MoEConfig`` (config/moe.py) is the ``moe:`` section of a recipe. ``moe_config_overrides`` turns it and an
:class:`Architecture` into the ``TransformerConfig`` fields of megatron-core's MoE layer:

- routing: softmax scores over ``num_experts``, top-k. Qwen3-MoE with ``norm_topk_prob`` renormalises the k
  selected probabilities; megatron's ``moe_router_pre_softmax=False`` (top-k on the logits, softmax over the
  k) is the same function. Without ``norm_topk_prob`` the softmax runs over all experts first
  (``moe_router_pre_softmax=True``) and the k probabilities are used as they are.
- router dtype: the router GEMM and softmax run in fp32 or fp64 whatever the model dtype (``router_dtype``);
  bf16 routing flips near-tied experts between the engine and the trainer.
- auxiliary losses: load-balancing and z-loss coefficients default to 0, as NeMo-RL does for RL
  ("seq_aux_loss causes logprob divergence"): an RL policy gradient should not carry a pre-training
  regulariser unless the recipe asks for one.
- experts: ``SequentialMLP`` (one ``linear_fc1``/``linear_fc2`` pair per local expert) on megatron's local
  spec (CPU), Transformer Engine's grouped GEMM (``TEGroupedMLP``) when TE imports (GPU clusters).
- DeepSeek-style routing (GLM-4.5, DeepSeek-V3; ``Architecture.router_score == "sigmoid"``): the router
  scores are ``sigmoid(logits)`` (megatron ``moe_router_score_function="sigmoid"``); the experts are chosen
  on ``scores + e_score_correction_bias`` (megatron's ``expert_bias`` buffer,
  ``moe_router_enable_expert_bias``), optionally within the ``topk_group`` best of ``n_group`` groups
  (``moe_router_num_groups``/``moe_router_group_topk``; ``Architecture`` refuses the configs where HF's
  top-2 group score and megatron's top-(k/topk_group) differ), and weighted by the scores WITHOUT the bias,
  normalised over the k and times ``routed_scaling_factor`` (``moe_router_topk_scaling_factor``). megatron
  always renormalises sigmoid weights when k > 1 and never at k = 1, so ``norm_topk_prob=false`` or k = 1
  are refused. Shared experts: one SwiGLU of ``n_shared_experts * moe_intermediate_size`` on every token,
  added to the routed output, no gate (``moe_shared_expert_intermediate_size``); dense first layers:
  ``moe_layer_freq = [0] * first_k_dense_replace + [1] * rest`` with a per-layer spec
  (``models.policy.decoder_spec``).
- the expert bias is a BUFFER, not a parameter: no gradient, no optimizer state. DeepSeek's aux-loss-free
  balancing moves it after every step by ``moe_router_bias_update_rate * sign(mean load - load)``
  (megatron's ``finalize_model_grads``). In RL it stays FROZEN by default
  (``moe.expert_bias_update_rate: 0.0``): the engine routes with the bias it was last sent, so a bias that
  moves every step changes the routing between rollout and training (the gap routing replay exists to
  close) and adds a pre-training load objective to the policy gradient; RL batches are also far too small
  and skewed (a few prompts) for a load statistic worth following. A recipe may set a small positive rate
  (DeepSeek-V3 pre-training used 1e-3) to keep experts balanced over a long run; the moved bias is then
  saved with the checkpoint and sent to the engine with the weights (``conversion/weights.py``
  ``policy_named_tensors``).
- dispatcher: ``alltoall`` (token all-to-all over EP; the production choice at EP > 1) or ``allgather``.

Expert parallel (EP) and expert-tensor parallel (ETP) sizes come from ``parallel_state`` (see
``srpo_megatron.parallel``); TP > 1 with MoE needs sequence parallelism in training (megatron refuses
otherwise), which ``build_policy`` switches on. megatron's local spec norm (``WrappedTorchNorm``) refuses
sequence parallelism, so under SP the local spec uses ``models.norms.SequenceParallelRMSNorm`` for every
norm (``models.policy.layer_spec``); on GPU, TE's norms support it natively.
"""

from __future__ import annotations

import torch

from srpo_megatron.config.moe import MoEConfig
from srpo_megatron.models.architecture import Architecture


def moe_config_overrides(
    arch: Architecture, moe: MoEConfig, *, ep: int, etp: int, use_te: bool, tp: int | None = None
) -> dict:
    """``TransformerConfig`` fields of ``arch``'s MoE layers under ``moe`` at expert parallel ep/etp (and
    tensor parallel ``tp``, when given, for the layout check below)."""
    if tp is not None and ep == 1 and etp > tp:
        # megatron-core marks expert weights ``allreduce = not (EP > 1)``: at EP1 they are reduced like dense
        # weights, over the dense DP group only. ETP < TP is mended by ``mark_tp_replicated_experts`` (the
        # TP-replicated experts get the expert-DP reduction, tests/dist/test_moe.py at TP2 x EP1 x ETP1);
        # ETP > TP at EP1 is not verified against HF, so it is refused.
        raise ValueError(
            f"parallel.ep=1 with parallel.etp={etp} > parallel.tp={tp} is not supported (megatron-core "
            "reduces expert weights like dense ones when EP=1, and this layout is not verified); set "
            "parallel.etp to at most parallel.tp, or use parallel.ep > 1"
        )
    if arch.num_experts % ep:
        raise ValueError(
            f"expert parallel size {ep} must divide num_experts={arch.num_experts} (each EP rank holds "
            "whole experts); choose parallel.ep from the divisors of num_experts"
        )
    if arch.moe_intermediate_size % etp:
        raise ValueError(
            f"expert tensor parallel size {etp} must divide "
            f"moe_intermediate_size={arch.moe_intermediate_size}"
        )
    grouped = use_te if moe.grouped_gemm is None else moe.grouped_gemm
    if grouped and not use_te:
        raise ValueError(
            "moe.grouped_gemm=true needs Transformer Engine (a GPU image); set it to null or false"
        )
    balancing = "aux_loss" if moe.aux_loss_coeff > 0 else "none"
    routing = _softmax_routing(arch) if arch.router_score == "softmax" else _sigmoid_routing(arch, moe)
    return dict(
        num_moe_experts=arch.num_experts,
        moe_router_topk=arch.moe_top_k,
        moe_ffn_hidden_size=arch.moe_intermediate_size,
        **routing,
        moe_router_load_balancing_type=balancing,
        moe_aux_loss_coeff=moe.aux_loss_coeff,
        moe_z_loss_coeff=moe.z_loss_coeff or None,
        moe_router_dtype=moe.router_dtype,
        moe_token_dispatcher_type=moe.dispatcher,
        moe_grouped_gemm=grouped,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )


def _softmax_routing(arch: Architecture) -> dict:
    """Qwen3-MoE: softmax scores, renormalised top-k when ``norm_topk_prob`` (see the module docstring)."""
    return dict(moe_router_score_function="softmax", moe_router_pre_softmax=not arch.norm_topk_prob)


def _sigmoid_routing(arch: Architecture, moe: MoEConfig) -> dict:
    """GLM-4.5 / DeepSeek-V3: sigmoid scores, selection-only expert bias, groups, scaled weights, shared
    experts, dense first layers (see the module docstring)."""
    if not arch.norm_topk_prob or arch.moe_top_k < 2:
        raise ValueError(
            f"{arch.model_type} with norm_topk_prob={arch.norm_topk_prob} and num_experts_per_tok="
            f"{arch.moe_top_k} cannot be reproduced: megatron's sigmoid router renormalises the top-k "
            "weights exactly when k > 1; use norm_topk_prob=true and num_experts_per_tok >= 2 (as the "
            "GLM-4.5 and DeepSeek-V3 checkpoints ship)"
        )
    fields: dict = dict(
        moe_router_score_function="sigmoid",
        moe_router_pre_softmax=False,
        moe_router_enable_expert_bias=arch.router_expert_bias,
        moe_router_bias_update_rate=moe.expert_bias_update_rate,
        moe_router_topk_scaling_factor=arch.routed_scaling_factor,
        moe_shared_expert_intermediate_size=arch.shared_expert_intermediate_size or None,
    )
    if arch.router_groups > 1:
        fields.update(moe_router_num_groups=arch.router_groups, moe_router_group_topk=arch.router_group_topk)
    if arch.first_dense_layers:
        fields["moe_layer_freq"] = [int(arch.is_moe_layer(i)) for i in range(arch.num_layers)]
    return fields


def apply_router_controls(model: torch.nn.Module, moe: MoEConfig) -> None:
    """Freeze every router weight when ``moe.freeze_router`` (megatron DDP then gives it no grad buffer)."""
    if not moe.freeze_router:
        return
    for name, param in model.named_parameters():
        if name.endswith("mlp.router.weight") or name.endswith("mlp.router.bias"):
            param.requires_grad_(False)


def router_params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The router parameters of a policy stage by local name (for tests and metrics)."""
    return {n: p for n, p in model.named_parameters() if ".mlp.router." in n}


def mark_tp_replicated_experts(model: torch.nn.Module, *, tp: int, ep: int, etp: int) -> None:
    """Give expert parameters replicated over TP their expert-data-parallel gradient reduction.

    megatron-core 0.16.1 marks an expert parameter for the expert-data-parallel reduction
    (``param.allreduce = False``) only when EP > 1. At EP 1 with ETP < TP each TP rank holds a full copy of
    the experts and routes only its sequence-parallel share of the tokens, so the copies' gradients must be
    summed over the expert-data-parallel group, which spans those TP ranks; as "dense" parameters they are
    reduced over the (smaller) data-parallel group and each copy keeps its own tokens' gradient
    (``tests/dist/test_gpt_oss.py`` at TP2, EP1, ETP1 compares with HF). Marking them as at EP > 1 gives
    megatron DDP and the optimizer the same grouping they use there.
    """
    if ep != 1 or etp == tp:
        return
    for name, param in model.named_parameters():
        if ".mlp.experts." in name:
            param.allreduce = False
