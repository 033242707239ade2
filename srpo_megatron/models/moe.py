"""Mixture-of-Experts policies (Qwen3-MoE): the recipe's router controls and megatron's MoE settings.

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


def moe_config_overrides(arch: Architecture, moe: MoEConfig, *, ep: int, etp: int, use_te: bool) -> dict:
    """``TransformerConfig`` fields of ``arch``'s MoE layers under ``moe`` at expert parallel ep/etp."""
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
    return dict(
        num_moe_experts=arch.num_experts,
        moe_router_topk=arch.moe_top_k,
        moe_ffn_hidden_size=arch.moe_intermediate_size,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not arch.norm_topk_prob,
        moe_router_load_balancing_type=balancing,
        moe_aux_loss_coeff=moe.aux_loss_coeff,
        moe_z_loss_coeff=moe.z_loss_coeff or None,
        moe_router_dtype=moe.router_dtype,
        moe_token_dispatcher_type=moe.dispatcher,
        moe_grouped_gemm=grouped,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
    )


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
