"""Build a megatron-core ``GPTModel`` policy from an HF config (Llama/SmolLM2, Qwen2/2.5, Qwen3, Qwen3-MoE,
GLM-4.5, DeepSeek-V3 (MLA: ``models/mla.py``)).

``transformer_config_from_hf`` maps an :class:`Architecture` onto megatron's ``TransformerConfig``
(RMSNorm, SwiGLU, GQA via ``num_query_groups``, explicit ``head_dim`` as ``kv_channels``, QKV bias,
QK-norm, norm epsilon, no dropout, fused kernels off: ``models/performance.py`` chooses the GPU overrides).
``build_policy`` builds the ``GPTModel`` for the calling rank's pipeline stage from layer specs: Transformer
Engine's spec when TE imports (GPU clusters), otherwise megatron's local spec with :class:`SDPACoreAttention`
swapped into the ``core_attention`` slot (and SP-aware norms under sequence parallelism, ``models/norms.py``).
The decoder's final norm is always named (``final_norm_spec``), never megatron's import-time default.
RoPE uses the model's theta; "linear" scaling maps to megatron's
``seq_len_interpolation_factor`` and "llama3" to ``rope_scaling``/``rope_scaling_factor``.

GLM-4.5 (``glm4_moe``): q/k/v bias and optional QK-norm as Qwen2/Qwen3; partial RoPE as megatron's
``rotary_percent`` (= ``partial_rotary_factor``): both rotate the FIRST ``head_dim * factor`` dims of every
q/k head with the non-interleaved rotate-half layout (HF's ``apply_rotary_pos_emb`` splits
``q[..., :rotary_dim]`` off, megatron's ``apply_rotary_pos_emb_bshd`` ``t[..., :rot_dim]``) and the same
inverse frequencies ``theta ** (-2i / rotary_dim)``; the DeepSeek-style MoE and its dense first layers
(``decoder_spec`` builds one spec per layer) are ``models/moe.py``'s.

TP and PP sizes and the stage come from ``megatron.core.parallel_state`` (initialise it first). The
vocabulary is padded to a multiple of ``128 * TP`` (see ``padded_vocab_size``); padded rows are zero, so
their logits are 0, not -inf: samplers, log-probs and entropies must exclude token ids >= ``vocab_size``
(slice after gathering, or mask the padded tail of the last TP shard).

Deviations from the HF models: attention runs through SDPA (same maths, different kernel order, fp32
differences ~1e-6); llama3 RoPE scaling accepts only megatron's fixed band parameters (see
``architecture.py``); sliding-window attention is rejected rather than approximated except for gpt-oss,
whose sinks, per-layer windows, biases, clamped SwiGLU and YaRN are ``models/gpt_oss.py``'s.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from srpo_megatron.config import ConfigError, MoEConfig
from srpo_megatron.models.architecture import Architecture, padded_vocab_size, pipeline_stage_layers
from srpo_megatron.models.attention import SDPACoreAttention
from srpo_megatron.models.gpt_oss import (
    gpt_oss_config_overrides,
    keep_expert_biases_out_of_the_sp_reduce,
    set_yarn_attributes,
    with_expert_biases,
)
from srpo_megatron.models.moe import apply_router_controls, mark_tp_replicated_experts, moe_config_overrides
from srpo_megatron.models.norms import SequenceParallelRMSNorm
from srpo_megatron.models.performance import transformer_engine_installed, transformer_engine_problem


def transformer_engine_available() -> bool:
    """True when Transformer Engine imports, False when it is not installed; a broken install raises
    :class:`ConfigError` with ``models/performance.transformer_engine_problem``'s line (no silent local
    spec)."""
    problem = transformer_engine_problem()
    if problem is not None:
        raise ConfigError(problem)
    return transformer_engine_installed()


def transformer_config_from_hf(
    arch: Architecture,
    *,
    tp: int = 1,
    pp: int = 1,
    params_dtype: torch.dtype = torch.float32,
    ep: int = 1,
    etp: int = 1,
    moe: MoEConfig | None = None,
    use_te: bool = False,
    **overrides: Any,
) -> TransformerConfig:
    """megatron ``TransformerConfig`` reproducing ``arch``; ``overrides`` set further TransformerConfig fields
    (e.g. ``recompute_granularity``); unknown names raise TypeError from the dataclass."""
    if arch.num_kv_heads % tp:
        raise ValueError(
            f"tensor parallel size {tp} must divide num_key_value_heads={arch.num_kv_heads} "
            "(each TP rank holds whole query groups)"
        )
    stages = pipeline_stage_layers(arch.num_layers, pp)
    uneven: dict[str, Any] = {}
    if len(set(stages)) > 1:  # megatron places first/last counts; the middle stages share the rest evenly
        uneven = dict(
            num_layers_in_first_pipeline_stage=stages[0], num_layers_in_last_pipeline_stage=stages[-1]
        )
    kwargs: dict[str, Any] = dict(
        **uneven,
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.intermediate_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        use_cpu_initialization=not torch.cuda.is_available(),
        # The fused kernels below need apex or TE; the unfused paths are numerically the reference.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
    )
    if arch.is_moe:
        kwargs.update(moe_config_overrides(arch, moe or MoEConfig(), ep=ep, etp=etp, use_te=use_te, tp=tp))
        # megatron's MoE layer refuses TP > 1 in training without sequence parallelism.
        kwargs["sequence_parallel"] = tp > 1
    if arch.model_type == "gpt_oss":  # sinks, sliding windows, biases, clamped SwiGLU (models/gpt_oss.py)
        kwargs.update(gpt_oss_config_overrides(arch))
    kwargs.update(overrides)
    if arch.model_type == "gpt_oss":  # no fused kernel for the alpha gate; TE's grouped MLP refuses
        kwargs.update(bias_activation_fusion=False, bias_dropout_fusion=False)  # bias-dropout fusion w/ bias
    if arch.is_mla:  # DeepSeek-V3: megatron's MLA config (models/mla.py)
        from srpo_megatron.models.mla import mla_transformer_config

        return mla_transformer_config(arch, kwargs)
    return TransformerConfig(**kwargs)


def layer_spec(
    arch: Architecture,
    *,
    use_te: bool | None = None,
    sequence_parallel: bool = False,
    moe_grouped_gemm: bool | None = None,
    moe_layer: bool | None = None,
) -> ModuleSpec:
    """Layer spec: TE's when available (or ``use_te=True``), else local with SDPA core attention (and, under
    sequence parallelism, :class:`SequenceParallelRMSNorm` norms: the local torch norm refuses SP). MoE
    architectures get megatron's MoE layer: TE grouped GEMM experts with TE (``moe_grouped_gemm`` None or
    True), ``SequentialMLP`` experts on the local spec (MoE with TP > 1 trains under SP); the shared experts
    come with it when the config sets ``moe_shared_expert_intermediate_size``. ``moe_layer``: this layer's
    MLP is MoE (default: whenever the architecture is MoE); False gives the dense MLP of the first
    ``first_dense_layers`` layers of GLM-4.5 / DeepSeek-V3."""
    if use_te is None:
        use_te = transformer_engine_available()
    if arch.is_mla:  # DeepSeek-V3: the MLP part as for any architecture, MLA attention (models/mla.py)
        from srpo_megatron.models.mla import with_mla_attention

        spec = layer_spec(
            dataclasses.replace(arch, kv_lora_rank=0, qk_norm=False),
            use_te=use_te,
            sequence_parallel=sequence_parallel,
            moe_grouped_gemm=moe_grouped_gemm,
            moe_layer=moe_layer,
        )
        return with_mla_attention(spec, use_te=use_te, sequence_parallel=sequence_parallel)
    # a DeepSeek-V3 config with first_k_dense_replace = every layer is not MoE (Architecture.is_moe)
    experts = arch.num_experts if arch.is_moe and moe_layer is not False else None
    if use_te:
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        grouped = experts is not None and moe_grouped_gemm is not False
        return get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts, moe_grouped_gemm=grouped, qk_layernorm=arch.qk_norm
        )
    spec = get_gpt_layer_local_spec(num_experts=experts, qk_layernorm=arch.qk_norm, normalization="RMSNorm")
    if experts and arch.linear_bias:  # gpt-oss: expert biases on megatron's local MoE layer
        spec = with_expert_biases(spec)
    attention = spec.submodules.self_attention
    attention_submodules = dataclasses.replace(attention.submodules, core_attention=SDPACoreAttention)
    norms: dict[str, Any] = {}
    if sequence_parallel:
        norms = dict(input_layernorm=SequenceParallelRMSNorm, pre_mlp_layernorm=SequenceParallelRMSNorm)
        if arch.qk_norm:
            attention_submodules = dataclasses.replace(
                attention_submodules, q_layernorm=SequenceParallelRMSNorm, k_layernorm=SequenceParallelRMSNorm
            )
    self_attention = dataclasses.replace(attention, submodules=attention_submodules)
    return dataclasses.replace(
        spec, submodules=dataclasses.replace(spec.submodules, self_attention=self_attention, **norms)
    )


def decoder_spec(
    arch: Architecture,
    config: TransformerConfig,
    *,
    use_te: bool,
    moe_grouped_gemm: bool | None = None,
    vp_stage: int | None = None,
) -> TransformerBlockSubmodules:
    """The decoder block's spec for ``config``: this stage's :func:`layer_spec` layers (the count from
    ``parallel_state``) and the final norm pinned by :func:`final_norm_spec`. With dense first layers
    (GLM-4.5, DeepSeek-V3) the block lists this stage's layer specs one by one, dense or MoE by global
    layer index (as megatron's ``get_gpt_decoder_block_spec`` does from ``moe_layer_freq``, but with this
    module's attention and norms in every layer)."""

    def spec_of(moe_layer: bool | None = None) -> ModuleSpec:
        return layer_spec(
            arch,
            use_te=use_te,
            sequence_parallel=config.sequence_parallel,
            moe_grouped_gemm=moe_grouped_gemm,
            moe_layer=moe_layer,
        )

    final_norm = final_norm_spec(config, use_te=use_te)
    if arch.is_moe and arch.first_dense_layers:
        first = get_transformer_layer_offset(config, vp_stage=vp_stage)
        count = get_num_layers_to_build(config, vp_stage=vp_stage)
        specs = {flag: spec_of(flag) for flag in (False, True)}
        return TransformerBlockSubmodules(
            layer_specs=[specs[arch.is_moe_layer(i)] for i in range(first, first + count)],
            layer_norm=final_norm,
        )
    return TransformerBlockSubmodules(
        layer_specs=[spec_of()] * get_num_layers_to_build(config, vp_stage=vp_stage), layer_norm=final_norm
    )


def final_norm_spec(config: TransformerConfig, *, use_te: bool) -> type:
    """The decoder's final norm, always explicit: a bare layer spec makes megatron's ``TransformerBlock``
    pick it at import time (``LayerNormImpl``: TENorm when TE imports, else apex's ``FusedLayerNorm`` when
    apex imports, else ``WrappedTorchNorm``; megatron-core 0.16.1 and 0.19.2 alike), and ``FusedLayerNorm``
    refuses RMSNorm. TE spec: ``TENorm`` (RMSNorm per the config); local spec: ``WrappedTorchNorm``
    (``torch.nn.RMSNorm``), or :class:`SequenceParallelRMSNorm` under sequence parallelism (megatron's
    torch norm refuses SP)."""
    if use_te:
        from megatron.core.extensions.transformer_engine import TENorm

        return TENorm
    return SequenceParallelRMSNorm if config.sequence_parallel else WrappedTorchNorm


def build_policy(
    hf_config: Any,
    *,
    params_dtype: torch.dtype = torch.float32,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    vp_stage: int | None = None,
    use_te: bool | None = None,
    max_sequence_length: int | None = None,
    parallel_output: bool = True,
    moe: MoEConfig | None = None,
    **config_overrides: Any,
) -> GPTModel:
    """The calling rank's pipeline stage of the policy described by ``hf_config``.

    ``hf_config``: model folder, config.json path, dict, ``PretrainedConfig`` or :class:`Architecture`.
    TP/PP sizes and the stage come from ``parallel_state``. The model lives on CUDA when available
    (caller moves it), otherwise on CPU with CPU initialisation. Output logits ``[b, s, V_pad/TP]``
    (vocab-parallel when ``parallel_output``). ``moe``: router/expert controls of an MoE architecture
    (EP/ETP sizes also come from ``parallel_state``).
    """
    arch = hf_config if isinstance(hf_config, Architecture) else Architecture.from_hf(hf_config)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if use_te is None:
        use_te = transformer_engine_available()
    moe = moe or MoEConfig()
    config = transformer_config_from_hf(
        arch,
        tp=tp,
        pp=pp,
        params_dtype=params_dtype,
        use_te=use_te,
        moe=moe,
        **_expert_parallel_sizes(arch),
        **config_overrides,
    )
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage(
            ignore_virtual=vp_stage is None, vp_stage=vp_stage
        )
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage(
            ignore_virtual=vp_stage is None, vp_stage=vp_stage
        )
    rope: dict[str, Any] = {}
    position_embedding = "rope"
    if arch.rope_type == "yarn" and not arch.is_mla:  # gpt-oss: YaRN on standard attention
        set_yarn_attributes(config, arch)
        position_embedding = "yarn"
    if arch.rope_type == "linear":
        rope["seq_len_interpolation_factor"] = arch.rope_factor
    elif arch.rope_type == "llama3":
        rope.update(rope_scaling=True, rope_scaling_factor=arch.rope_factor)
    spec = decoder_spec(arch, config, use_te=use_te, moe_grouped_gemm=moe.grouped_gemm, vp_stage=vp_stage)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=padded_vocab_size(arch.vocab_size, tp),
        max_sequence_length=max_sequence_length or arch.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=parallel_output,
        share_embeddings_and_output_weights=arch.tie_embeddings,
        position_embedding_type=position_embedding,
        rotary_percent=arch.rotary_percent,
        rotary_base=int(arch.rope_theta) if float(arch.rope_theta).is_integer() else arch.rope_theta,
        vp_stage=vp_stage,
        **rope,
    )
    if arch.is_moe and arch.linear_bias:  # gpt-oss: expert biases out of the SP all-reduce, any spec
        keep_expert_biases_out_of_the_sp_reduce(model)
    if arch.is_moe:
        apply_router_controls(model, moe)
        ep, etp = config.expert_model_parallel_size, config.expert_tensor_parallel_size
        mark_tp_replicated_experts(model, tp=tp, ep=ep, etp=etp)
    return model


def _expert_parallel_sizes(arch: Architecture) -> dict[str, int]:
    """EP/ETP sizes of the parallel state for an MoE architecture (none for dense models)."""
    if not arch.is_moe:
        return {}
    from srpo_megatron.compat.cpu import bind_missing_te_names

    bind_missing_te_names()
    return dict(
        ep=parallel_state.get_expert_model_parallel_world_size(),
        etp=parallel_state.get_expert_tensor_parallel_world_size(),
    )
