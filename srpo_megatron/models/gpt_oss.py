"""gpt-oss (HF ``gpt_oss``: gpt-oss-20b/120b) on megatron-core: the ``TransformerConfig`` fields and RoPE.

Each HF feature maps onto an existing megatron-core 0.16.1 setting (checked against transformers 5.24's
``modeling_gpt_oss.py``; ``tests/dist/test_gpt_oss.py`` compares logits and every gradient):

- attention sinks (HF ``self_attn.sinks``, one logit per query head in every softmax row, its probability
  dropped): ``softmax_type="learnable"``, megatron's per-head ``softmax_offset`` parameter (TE's attention
  takes it on GPU; :class:`SDPACoreAttention` implements it on CPU);
- sliding windows (HF ``layer_types`` + ``sliding_window`` W: a query attends the W keys ending at itself):
  ``window_size=(W - 1, 0)`` and ``window_attn_skip_freq`` as a per-layer list (1 = sliding), megatron's
  1-based layer numbering, so any ``layer_types`` pattern is expressed exactly;
- biases on q/k/v, o, the router and the experts: ``add_qkv_bias`` + ``add_bias_linear`` (megatron then
  needs ETP 1 with MoE; each expert's fc2 bias is scaled by its routing weight, as HF does);
- the clamped SwiGLU ``(clamp(up, ±limit) + 1) * g * sigmoid(alpha * g)``, ``g = clamp(gate, max=limit)``:
  megatron's unfused GLU with ``activation_func_clamp_value=limit`` (the same two clamps),
  ``glu_linear_offset=1`` and the gate activation ``x * sigmoid(alpha * x)`` (``alpha_sigmoid_gate``).
  megatron's fc1 is ``[gate; up]``; HF's ``gate_up_proj`` interleaves them (the conversion table splits);
- the router: a linear with bias, top-k on the logits, softmax over the k: ``moe_router_pre_softmax=False``
  (``models/moe.py``, ``norm_topk_prob=True``);
- YaRN RoPE with ``truncate=False``: ``position_embedding_type="yarn"`` with the ``yarn_*`` attributes that
  ``GPTModel`` reads via getattr (a plain ``TransformerConfig`` has no such fields, so they are set on the
  instance); megatron's attention multiplies cos/sin of q and k by the concentration factor, HF's
  ``attention_scaling`` (``0.1 ln(factor) + 1``).

The bias-activation and bias-dropout fusions stay off for gpt-oss whatever ``performance.fusions`` says
(``policy.transformer_config_from_hf``): the alpha gate has no fused kernel, and TE's grouped MLP refuses
bias-dropout fusion with biases.

Not verified on a GPU: TE's sink support (``softmax_type`` needs TE >= 2.8 and its fused attention) and TE's
sliding windows with sinks.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any

import torch
from megatron.core.tensor_parallel.layers import RowParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec

from srpo_megatron.models.architecture import Architecture


def alpha_sigmoid_gate(x: torch.Tensor, alpha: float) -> torch.Tensor:
    """gpt-oss's gate activation ``x * sigmoid(alpha * x)`` (megatron's ``quick_gelu`` at alpha 1.702, but
    that one is ``torch.compile``d and fixes alpha)."""
    return x * torch.sigmoid(alpha * x)


def gpt_oss_config_overrides(arch: Architecture) -> dict[str, Any]:
    """``TransformerConfig`` fields of gpt-oss's attention and experts (see the module docstring)."""
    fields: dict[str, Any] = dict(
        add_bias_linear=arch.linear_bias,
        add_qkv_bias=arch.qkv_bias,
        softmax_type="learnable" if arch.attention_sinks else "vanilla",
    )
    if any(arch.is_sliding_layer(i) for i in range(arch.num_layers)):
        fields.update(
            window_size=(arch.sliding_window - 1, 0),
            window_attn_skip_freq=[int(arch.is_sliding_layer(i)) for i in range(arch.num_layers)],
        )
    if arch.swiglu_limit > 0:
        fields.update(
            activation_func=functools.partial(alpha_sigmoid_gate, alpha=arch.swiglu_alpha),
            activation_func_clamp_value=arch.swiglu_limit,
            glu_linear_offset=1.0,
        )
    return fields


def set_yarn_attributes(config, arch: Architecture) -> None:
    """The ``yarn_*`` attributes ``GPTModel`` (``position_embedding_type="yarn"``) and megatron's attention
    (the concentration factor on cos/sin) read from a standard-attention config."""
    y = arch.yarn
    if y is None:
        return
    if y.mscale is not None or y.mscale_all_dim is not None:
        raise ValueError(
            "yarn mscale/mscale_all_dim on standard attention is not verified against HF (only MLA uses "
            "them); gpt-oss configs have neither"
        )
    config.yarn_rotary_scaling_factor = y.factor
    config.yarn_original_max_position_embeddings = y.original_max_position_embeddings
    config.yarn_beta_fast = y.beta_fast
    config.yarn_beta_slow = y.beta_slow
    config.yarn_mscale = None  # concentration factor = 0.1 ln(factor) + 1, HF's attention_scaling
    config.yarn_mscale_all_dim = None
    config.yarn_correction_range_round_to_int = y.truncate


class ExpertRowParallelLinear(RowParallelLinear):
    """An expert's ``linear_fc2`` with a bias, as megatron-core 0.16.1's local MoE path needs it. Two fixes:

    - the bias is not a sequence-parallel parameter: megatron marks every ``RowParallelLinear`` bias
      ``sequence_parallel`` under SP, and ``finalize_model_grads`` then all-reduces its gradient over TP,
      which for an expert (a different expert on each rank of the TP x EP group, or a TP-replicated copy
      already reduced over expert-DP) mixes or doubles gradients;
    - ``MLP.forward`` adds the bias in place (``output += bias * probs``); with one rank in the expert group
      (TP1, EP1) ``RowParallelLinear`` returns its matmul through an identity autograd Function, whose
      output autograd forbids modifying in place, so that case returns a copy.

    ``tests/dist/test_gpt_oss.py`` (TP2, TP2xEP2 and TP1 against HF) fails without either.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.bias is not None and self.is_expert:
            self.bias.sequence_parallel = False

    def forward(self, input_, *args, **kwargs):
        output, bias = super().forward(input_, *args, **kwargs)
        if bias is not None and self.is_expert and not self.explicit_expert_comm:
            output = output.clone()
        return output, bias


EXPERT_BIAS = re.compile(r".*\.mlp\.experts\..*bias\d*")  # SequentialMLP's linear_fc2.bias, TE's bias0..N


def keep_expert_biases_out_of_the_sp_reduce(model: torch.nn.Module) -> list[str]:
    """Clear ``sequence_parallel`` on every routed-expert bias of a built model, whatever the spec; returns
    the names. ``finalize_model_grads`` all-reduces over TP every parameter marked ``sequence_parallel``
    under SP; an expert bias is a different expert per rank of the TP x EP group, or a TP-replicated copy
    that DDP already reduces over expert-DP, so that reduce mixes or doubles its gradient.

    Who marks them (read from the sources): megatron-core 0.16.1's local ``RowParallelLinear`` always under
    SP (hence :class:`ExpertRowParallelLinear` on the local spec); on the TE spec, TE's ``GroupedLinear`` /
    ``Linear`` mark a row-parallel bias ``(tp_size > 1) and sequence_parallel`` with the expert TP size
    megatron passes (gpt-oss runs ETP 1, and explicit expert comms pass ``parallel_mode=None``: unmarked),
    but megatron-core 0.19.2's ``TERowParallelLinear`` (the non-grouped TE experts) sets
    ``bias.sequence_parallel = config.sequence_parallel`` itself under ``use_cpu_initialization``, and its
    ``_set_expert_parameter_attributes`` (run on every TE expert linear) never clears it. This pass makes the
    TE spec as safe as the local one without depending on those details."""
    names = []
    for name, param in model.named_parameters():
        if EXPERT_BIAS.fullmatch(name):
            param.sequence_parallel = False
            names.append(name)
    return names


def with_expert_biases(spec: ModuleSpec) -> ModuleSpec:
    """The local MoE layer spec with :class:`ExpertRowParallelLinear` as the routed experts' fc2.
    megatron-core 0.16 builds the MoE layer and its experts as ``ModuleSpec``s, 0.19 as partials."""
    mlp = _submodules(spec.submodules.mlp)
    experts = _submodules(mlp.experts)
    experts = _with_submodules(mlp.experts, dataclasses.replace(experts, linear_fc2=ExpertRowParallelLinear))
    moe = _with_submodules(spec.submodules.mlp, dataclasses.replace(mlp, experts=experts))
    return dataclasses.replace(spec, submodules=dataclasses.replace(spec.submodules, mlp=moe))


def _submodules(spec):
    return spec.keywords["submodules"] if isinstance(spec, functools.partial) else spec.submodules


def _with_submodules(spec, submodules):
    if isinstance(spec, functools.partial):
        return functools.partial(spec.func, *spec.args, **{**spec.keywords, "submodules": submodules})
    return dataclasses.replace(spec, submodules=submodules)
