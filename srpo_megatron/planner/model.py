"""What one rank of a megatron GPTModel holds: model shape, parallel layout and parameter tensors.

``ModelShape.from_hf`` reads every config :class:`Architecture` parses: dense Qwen3/Qwen2/Llama, Qwen3-MoE
(``num_experts``, ``moe_intermediate_size``, ``num_experts_per_tok``, ``decoder_sparse_step``,
``mlp_only_layers``), DeepSeek-V3 (MLA, dense first layers, shared experts), GLM-4.5 and gpt-oss.
``param_tensors(shape, layout, stage)`` lists the numel of every parameter tensor that pipeline stage
``stage`` builds on one rank, in megatron-core's layout (the GPU one: Transformer Engine specs):

- attention: fused QKV ``[(q + 2kv)/TP, H]`` (+ bias), output ``[H, q/TP]`` (+ bias ``[H]``, gpt-oss),
  QK-norm weights ``[hd]``, the learnable softmax offset (gpt-oss's sinks) ``[heads/TP]``;
- Multi-head Latent Attention (DeepSeek-V3; megatron's ``MLASelfAttention``): the down projections
  ``linear_q_down_proj [r_q, H]`` and ``linear_kv_down_proj [r_kv + d_rope, H]`` and the two latent
  RMSNorms ``[r_q]``, ``[r_kv]`` are REPLICATED on every TP rank (TE's ``parallel_mode='duplicated'``:
  their outputs are the small latents every head needs); the up projections ``linear_q_up_proj
  [heads·(d_nope + d_rope)/TP, r_q]`` (or ``linear_q_proj [heads·d_qk/TP, H]`` without q compression),
  ``linear_kv_up_proj [heads·(d_nope + d_v)/TP, r_kv]`` and the output ``[H, heads·d_v/TP]`` are split by
  heads;
- dense MLP (all layers of a dense model, the first ``first_k_dense_replace`` of DeepSeek-V3/GLM-4.5):
  SwiGLU fc1 ``[2F/TP, H]`` and fc2 ``[H, F/TP]``;
- MoE MLP: router ``[E, H]`` (+ bias ``[E]``, gpt-oss; replicated), ``E/EP`` local experts of fc1
  ``[2Fe/ETP, H]`` and fc2 ``[H, Fe/ETP]`` (+ biases ``[2Fe/ETP]``, ``[H]``, gpt-oss; expert-parallel
  params: reduced and sharded over the expert-data-parallel group), then the shared experts (DeepSeek-V3,
  GLM-4.5: one SwiGLU of ``Fs = n_shared · Fe``, split by TP like a dense MLP, not expert-parallel);
- embedding ``[V_pad/TP, H]`` on the first stage, output layer ``[V_pad/TP, H]`` and final norm on the
  last (also when embeddings are tied and PP > 1: megatron keeps a synced copy there).

Not parameters, not counted: the router's expert bias (DeepSeek's ``e_score_correction_bias``, megatron's
``expert_bias``) is a buffer in both HF (``nn.Buffer``: in ``model.buffers()``, not in
``model.parameters()``) and megatron (a registered buffer the DDP grad buffers and the optimizer never
see); ``router_buffer_elements`` counts it (fp32, ``[E]`` per MoE layer). The MTP layers of DeepSeek-V3 and
GLM-4.5 checkpoints (``num_nextn_predict_layers``) are not part of the policy (not trained; re-emitted
unchanged on export): not in the counts, the memory or the engine's weights; ``mtp_params`` says how
large they are. The hub's storage quantization (DeepSeek-V3's fp8 128×128 blocks, gpt-oss's MXFP4
experts) is not planned: the policy trains in bf16, its checkpoints are converted to bf16 and the engine
receives the policy's bf16 weights, so every weight is planned at the params dtype.

Context parallelism splits sequences, not weights, so CP ranks hold the same tensors as CP = 1. Layers
are split evenly over PP stages, or, when PP does not divide them, with ``ceil(L/PP)`` layers on the
middle stages and the rest shared between the first and last (megatron's
``num_layers_in_first/last_pipeline_stage``; e.g. 94 layers on PP 8 → 11, 12 × 6, 11).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from srpo_megatron.models.architecture import (
    Architecture,
    load_hf_config_dict,
    padded_vocab_size,
    pipeline_stage_layers,
)


class PlanError(ValueError):
    """A layout or model the planner cannot plan; the message names the value and the fix."""


@dataclass(frozen=True)
class ModelShape:
    """The sizes that decide a decoder's parameters, activations and KV cache."""

    name: str  # label for tables (HF architectures[0] or model_type)
    vocab_size: int  # HF vocabulary rows (padded per TP by padded_vocab_size)
    hidden_size: int  # H
    ffn_hidden_size: int  # F of dense MLP layers
    num_layers: int  # L
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads
    head_dim: int  # hd
    qkv_bias: bool  # q/k/v biases (Qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k (Qwen3)
    tie_embeddings: bool  # lm_head shares the embedding
    num_experts: int = 0  # E routed experts per MoE layer (0 = dense model)
    moe_ffn_hidden_size: int = 0  # Fe of one expert
    moe_topk: int = 0  # experts per token
    moe_layers: tuple[bool, ...] = ()  # per layer: MoE MLP (True) or dense MLP
    shared_ffn_hidden_size: int = 0  # Fs: the shared experts' SwiGLU width (0: none)
    router_expert_bias: bool = False  # an expert-bias buffer [E] per MoE layer (not a parameter)
    mtp_layers: int = 0  # MTP layers of the checkpoint, not part of the policy
    # Multi-head Latent Attention (kv_lora_rank > 0); head_dim is then d_nope + d_rope
    q_lora_rank: int = 0  # r_q (0: one q projection)
    kv_lora_rank: int = 0  # r_kv
    qk_rope_head_dim: int = 0  # d_rope
    v_head_dim: int = 0  # d_v
    # gpt-oss
    linear_bias: bool = False  # biases on the attention output, the router and the experts
    attention_sinks: bool = False  # a learnable sink logit per head
    sliding_window: int = 0  # keys per query in a sliding layer
    sliding_layers: tuple[bool, ...] = ()  # per layer: sliding-window attention
    hub_quantization: str = ""  # the checkpoint's storage quantization ("fp8", "mxfp4"); planned as bf16

    @classmethod
    def from_hf(cls, config: object) -> ModelShape:
        """From an HF config (folder, config.json, dict); Qwen3-MoE here, the rest via Architecture."""
        cfg = load_hf_config_dict(config)
        moe = cfg.get("model_type") == "qwen3_moe"
        dense_cfg = {**cfg, "model_type": "qwen3"} if moe else cfg
        arch = Architecture.from_hf(dense_cfg)
        name = (cfg.get("architectures") or [cfg.get("model_type", "model")])[0]
        extra: dict[str, object] = {}
        if moe:
            n = arch.num_layers
            step = int(cfg.get("decoder_sparse_step", 1) or 1)
            dense_only = set(cfg.get("mlp_only_layers") or [])
            experts = int(cfg["num_experts"])
            extra = dict(
                num_experts=experts,
                moe_ffn_hidden_size=int(cfg["moe_intermediate_size"]),
                moe_topk=int(cfg["num_experts_per_tok"]),
                moe_layers=tuple(
                    experts > 0 and i not in dense_only and (i + 1) % step == 0 for i in range(n)
                ),
            )
        if arch.model_type in ("deepseek_v3", "glm4_moe", "gpt_oss"):  # Kimi-K2's kimi_k2 too
            n = arch.num_layers
            extra = dict(
                num_experts=arch.num_experts,
                moe_ffn_hidden_size=arch.moe_intermediate_size,
                moe_topk=arch.moe_top_k,
                moe_layers=tuple(arch.is_moe_layer(i) for i in range(n)),
                shared_ffn_hidden_size=arch.shared_expert_intermediate_size,
                router_expert_bias=arch.router_expert_bias,
                mtp_layers=arch.mtp_layers,
                q_lora_rank=arch.q_lora_rank or 0,
                kv_lora_rank=arch.kv_lora_rank,
                qk_rope_head_dim=arch.qk_rope_head_dim,
                v_head_dim=arch.v_head_dim,
                linear_bias=arch.linear_bias,
                attention_sinks=arch.attention_sinks,
                sliding_window=arch.sliding_window,
                sliding_layers=tuple(arch.is_sliding_layer(i) for i in range(n)),
                hub_quantization=str((cfg.get("quantization_config") or {}).get("quant_method") or ""),
            )
        return cls(
            name=name,
            vocab_size=arch.vocab_size,
            hidden_size=arch.hidden_size,
            ffn_hidden_size=arch.intermediate_size,
            num_layers=arch.num_layers,
            num_heads=arch.num_heads,
            num_kv_heads=arch.num_kv_heads,
            head_dim=arch.head_dim,
            qkv_bias=arch.qkv_bias,
            qk_norm=arch.qk_norm,
            tie_embeddings=arch.tie_embeddings,
            **extra,  # type: ignore[arg-type]
        )

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, i: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[i]

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    def is_sliding_layer(self, i: int) -> bool:
        return bool(self.sliding_layers) and self.sliding_layers[i]


@dataclass(frozen=True)
class Layout:
    """A parallel layout of ``world = tp * pp * cp * dp`` ranks; experts over ``ep * etp`` within a stage."""

    tp: int = 1  # tensor parallel
    pp: int = 1  # pipeline stages
    cp: int = 1  # context parallel (sequence split; weights replicated)
    dp: int = 1  # data parallel (without CP)
    ep: int = 1  # expert parallel (MoE)
    etp: int = 1  # expert tensor parallel (MoE)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def dense_shard_group(self) -> int:
        """Ranks the distributed optimizer shards dense params over (megatron: DP with CP)."""
        return self.dp * self.cp

    @property
    def expert_dp(self) -> int:
        """Expert-data-parallel size: ranks holding the same experts."""
        return self.world // (self.pp * self.ep * self.etp)

    def label(self) -> str:
        parts = [f"TP{self.tp}", f"PP{self.pp}", f"CP{self.cp}"]
        if self.ep > 1 or self.etp > 1:
            parts += [f"EP{self.ep}"] + ([f"ETP{self.etp}"] if self.etp > 1 else [])
        return " ".join([*parts, f"DP{self.dp}"])

    def check(self, shape: ModelShape) -> None:
        """Raise PlanError when megatron cannot build ``shape`` at this layout."""
        if min(self.tp, self.pp, self.cp, self.dp, self.ep, self.etp) < 1:
            raise PlanError(f"layout {self}: every size must be >= 1")
        if shape.num_kv_heads % self.tp:
            raise PlanError(
                f"TP {self.tp} does not divide num_key_value_heads={shape.num_kv_heads}; "
                "use a TP that divides it"
            )
        stage_layers(shape.num_layers, self.pp)
        if shape.is_moe:
            if shape.num_experts % self.ep:
                raise PlanError(f"EP {self.ep} does not divide num_experts={shape.num_experts}")
            if (self.world // self.pp) % (self.ep * self.etp):
                raise PlanError(
                    f"EP {self.ep} x ETP {self.etp} does not divide the {self.world // self.pp} ranks of a "
                    "pipeline stage; pick EP*ETP dividing TP*CP*DP"
                )
            if shape.moe_ffn_hidden_size % self.etp:
                raise PlanError(f"ETP {self.etp} does not divide moe_intermediate_size")
            if shape.linear_bias and self.etp > 1:
                raise PlanError(
                    f"ETP {self.etp} with expert biases (gpt-oss): megatron-core supports biases in MoE "
                    "experts only at expert tensor parallel 1; set parallel.etp=1"
                )
            if shape.shared_ffn_hidden_size % self.tp:
                raise PlanError(
                    f"TP {self.tp} does not divide the shared experts' width {shape.shared_ffn_hidden_size} "
                    "(n_shared_experts * moe_intermediate_size); use a TP that divides it"
                )
        elif self.ep != 1 or self.etp != 1:
            raise PlanError(f"EP {self.ep} / ETP {self.etp} need an MoE model; set parallel.ep=1")


def stage_layers(num_layers: int, pp: int) -> list[int]:
    """Layers per pipeline stage: the trainer's split (``models.architecture.pipeline_stage_layers``)."""
    try:
        return pipeline_stage_layers(num_layers, pp)
    except ValueError as e:
        raise PlanError(str(e)) from None


@dataclass(frozen=True)
class ParamTensor:
    """One parameter tensor of a rank: its element count and whether it is an expert (EP) parameter."""

    numel: int
    expert: bool = False
    shared: bool = False  # a tied embedding/output weight: megatron gives it a bucket of its own


def attention_numels(shape: ModelShape, tp: int, local_spec: bool = False) -> list[int]:
    """One layer's attention parameters on one TP rank (input norm first), in megatron's order.

    ``local_spec``: MLA as megatron's local (CPU) spec builds it, whose down projections are
    ``ColumnParallelLinear`` (split by TP, gathered after) and whose two latent norms come last; the plan
    is for GPUs, where Transformer Engine's ``TELinear(parallel_mode='duplicated')`` keeps them whole and
    ``TELayerNormColumnParallelLinear`` holds each norm in front of its up projection."""
    h, hd, heads = shape.hidden_size, shape.head_dim, shape.num_heads
    if shape.is_mla:
        d_rope, d_v = shape.qk_rope_head_dim, shape.v_head_dim
        d_nope, r_q, r_kv = hd - d_rope, shape.q_lora_rank, shape.kv_lora_rank
        down = tp if local_spec else 1
        out = [h, h * (heads * d_v // tp)]  # input norm, output projection (split by heads)
        # q down (replicated on GPUs) and q up, or one q projection without q compression
        q = [r_q // down * h, heads * hd // tp * r_q] if r_q else [heads * hd // tp * h]
        kv = [(r_kv + d_rope) // down * h, heads * (d_nope + d_v) // tp * r_kv]  # kv down, kv up
        norms = [r_q] * bool(r_q) + [r_kv]
        if local_spec:
            return out + q + kv + norms
        return out + q[:1] + norms[:-1] + q[1:] + kv[:1] + norms[-1:] + kv[1:]
    q, kv = heads * hd, shape.num_kv_heads * hd
    # megatron's order: input norm, core attention (sinks), output (+ bias), fused QKV (+ bias), q/k norms
    out = [h] + ([heads // tp] if shape.attention_sinks else []) + [h * (q // tp)]
    out += [h] if shape.linear_bias else []
    out.append((q + 2 * kv) // tp * h)
    out += [(q + 2 * kv) // tp] if shape.qkv_bias else []
    out += [hd, hd] if shape.qk_norm else []
    return out


def mlp_numels(shape: ModelShape, layout: Layout, moe: bool) -> tuple[list[int], list[int]]:
    """(dense params, ONE local expert's params) of a layer's MLP block on one rank, pre-MLP norm first;
    the layer holds ``num_experts / EP`` copies of the expert list, between the router and the shared
    experts (megatron's MoELayer registers router, experts, shared experts)."""
    h = shape.hidden_size
    if not moe:
        f = shape.ffn_hidden_size // layout.tp
        return [h, 2 * f * h, h * f], []
    fe = shape.moe_ffn_hidden_size // layout.etp
    dense = [h, shape.num_experts * h] + ([shape.num_experts] if shape.linear_bias else [])
    expert = [2 * fe * h] + ([2 * fe] if shape.linear_bias else []) + [h * fe]
    expert += [h] if shape.linear_bias else []
    return dense, expert


def shared_expert_numels(shape: ModelShape, tp: int) -> list[int]:
    """The shared experts of an MoE layer on one TP rank (fc1, fc2; split by TP like a dense MLP)."""
    if not shape.shared_ffn_hidden_size:
        return []
    fs = shape.shared_ffn_hidden_size // tp
    return [2 * fs * shape.hidden_size, shape.hidden_size * fs]


def param_tensors(
    shape: ModelShape, layout: Layout, stage: int, local_spec: bool = False
) -> list[ParamTensor]:
    """Every parameter tensor pipeline stage ``stage`` holds on one rank (TP/EP/ETP-sharded sizes), in the
    order of megatron's ``named_parameters()`` (which decides DDP bucket boundaries); ``local_spec``: MLA
    as the CPU spec builds it (see :func:`attention_numels`)."""
    tp, h = layout.tp, shape.hidden_size
    layers = stage_layers(shape.num_layers, layout.pp)
    first_layer = sum(layers[:stage])
    v_pad = padded_vocab_size(shape.vocab_size, tp)
    out: list[ParamTensor] = []
    if stage == 0:
        out.append(ParamTensor(v_pad // tp * h, shared=shape.tie_embeddings))
    attention = [ParamTensor(n) for n in attention_numels(shape, tp, local_spec)]
    for i in range(first_layer, first_layer + layers[stage]):
        out += attention
        moe = shape.is_moe_layer(i)
        dense, expert = mlp_numels(shape, layout, moe)
        out += [ParamTensor(n) for n in dense]
        if moe:
            for _ in range(shape.num_experts // layout.ep):
                out += [ParamTensor(n, True) for n in expert]
            out += [ParamTensor(n) for n in shared_expert_numels(shape, tp)]
    if stage == layout.pp - 1:
        out.append(ParamTensor(h))  # final norm
        if not (shape.tie_embeddings and layout.pp == 1):
            out.append(ParamTensor(v_pad // tp * h, shared=shape.tie_embeddings))
    return out


def stage_param_counts(shape: ModelShape, layout: Layout, stage: int) -> tuple[int, int]:
    """(dense, expert) parameter elements of a stage, by arithmetic (equals summing ``param_tensors``)."""
    tp, h = layout.tp, shape.hidden_size
    layers = stage_layers(shape.num_layers, layout.pp)
    first = sum(layers[:stage])
    v_rows = padded_vocab_size(shape.vocab_size, tp) // tp
    attn = sum(attention_numels(shape, tp))
    per_kind = {}
    for moe in (False, True):
        dense, expert = mlp_numels(shape, layout, moe)
        shared = sum(shared_expert_numels(shape, tp)) if moe else 0
        experts = shape.num_experts // layout.ep * sum(expert) if moe else 0
        per_kind[moe] = (attn + sum(dense) + shared, experts)
    dense = expert = 0
    for i in range(first, first + layers[stage]):
        d, e = per_kind[shape.is_moe_layer(i)]
        dense, expert = dense + d, expert + e
    if stage == 0:
        dense += v_rows * h
    if stage == layout.pp - 1:
        dense += h + (0 if shape.tie_embeddings and layout.pp == 1 else v_rows * h)
    return dense, expert


@functools.lru_cache(maxsize=64)
def total_params(shape: ModelShape) -> int:
    """Unsharded parameter count of the policy (HF vocabulary, tied embeddings counted once): what HF's
    ``model.parameters()`` sums to; without the MTP layers and the expert-bias buffers."""
    dense, expert = stage_param_counts(shape, Layout(), 0)
    padding_rows = padded_vocab_size(shape.vocab_size, 1) - shape.vocab_size
    return dense + expert - padding_rows * shape.hidden_size * (1 if shape.tie_embeddings else 2)


def active_params(shape: ModelShape, input_embedding: bool = True, output_layer: bool = True) -> int:
    """Parameters one token's forward uses: ``total_params`` less the ``E - k`` routed experts it skips in
    every MoE layer; ``input_embedding`` / ``output_layer`` False leave those out (published "active"
    figures differ on them: DeepSeek-V3's 37B counts both, GLM-4.5's 32B neither, gpt-oss's 5.1B / 3.6B
    the output layer only)."""
    _, expert = mlp_numels(shape, Layout(), True)
    moe_layers = sum(shape.is_moe_layer(i) for i in range(shape.num_layers))
    idle = moe_layers * (shape.num_experts - shape.moe_topk) * sum(expert) if shape.is_moe else 0
    emb = shape.vocab_size * shape.hidden_size
    left_out = (0 if input_embedding else emb) + (0 if output_layer or shape.tie_embeddings else emb)
    return total_params(shape) - idle - left_out


def router_buffer_elements(shape: ModelShape) -> int:
    """fp32 elements of the expert-bias buffers ([E] per MoE layer): HF's ``model.buffers()`` named
    ``e_score_correction_bias``, megatron's ``expert_bias``; not parameters."""
    if not shape.router_expert_bias:
        return 0
    return shape.num_experts * sum(shape.is_moe_layer(i) for i in range(shape.num_layers))


def mtp_params(shape: ModelShape) -> int:
    """Parameters of the checkpoint's MTP layers, excluded from the policy: per layer its two input norms
    (``enorm``, ``hnorm``), ``eh_proj [H, 2H]``, one MoE decoder layer and the ``shared_head`` norm (the
    copies of the embedding and output layer some checkpoints store with it are not counted)."""
    h = shape.hidden_size
    dense, expert = mlp_numels(shape, Layout(), True)
    layer = sum(attention_numels(shape, 1)) + sum(dense) + shape.num_experts * sum(expert)
    layer += sum(shared_expert_numels(shape, 1))
    return shape.mtp_layers * (3 * h + 2 * h * h + layer)


def ddp_bucket_size(shard_group: int, overlap_grad_reduce: bool) -> int | None:
    """megatron DDP's default bucket size in elements (None: one bucket, without overlapped reduction)."""
    return max(40_000_000, 1_000_000 * shard_group) if overlap_grad_reduce else None


def buffer_buckets(
    tensors: list[ParamTensor], shard_group: int, distributed_optimizer: bool, bucket_size: int | None = None
) -> list[tuple[int, int, list[tuple[int, int]]]]:
    """megatron DDP's buckets for ``tensors`` (in model order): ``(start, end, [(param start, end), ...])``.

    Mirrors megatron-core 0.16 ``_ParamAndGradBuffer``: params are laid out in reverse order; a bucket
    closes once it holds ``bucket_size`` elements, and a tied embedding weight gets a bucket of its own.
    With the distributed optimizer each param starts at a multiple of 64 elements and each bucket ends at
    a multiple of lcm(shard_group, 128); without it nothing is padded.
    """
    align, divisor = (64, math.lcm(shard_group, 128)) if distributed_optimizer else (1, 1)
    pad = lambda n, d: -(-n // d) * d  # noqa: E731
    buckets: list[tuple[int, int, list[tuple[int, int]]]] = []
    start = bucket_start = 0
    params: list[tuple[int, int]] = []
    for t in reversed(tensors):
        start = pad(start, align)
        if t.shared and params:
            closed_end = pad(start, divisor)
            buckets.append((bucket_start, closed_end, params))
            start = bucket_start = closed_end
            params = []
        end = start + t.numel
        params.append((start, end))
        if (bucket_size is not None and end - bucket_start >= bucket_size) or t.shared:
            buckets.append((bucket_start, pad(end, divisor), params))
            start = bucket_start = pad(end, divisor)
            params = []
        else:
            start = end
    if params:
        buckets.append((bucket_start, pad(start, divisor), params))
    return buckets


def buffer_numel(
    tensors: list[ParamTensor], shard_group: int, distributed_optimizer: bool, bucket_size: int | None = None
) -> int:
    """Elements of megatron DDP's contiguous param/grad buffer holding ``tensors`` (see buffer_buckets)."""
    buckets = buffer_buckets(tensors, shard_group, distributed_optimizer, bucket_size)
    return buckets[-1][1] if buckets else 0


def optimizer_shard_numel(
    tensors: list[ParamTensor], shard_group: int, distributed_optimizer: bool, bucket_size: int | None = None
) -> int:
    """Parameter elements whose fp32 main copy and Adam moments the busiest rank holds.

    Without the distributed optimizer every rank holds all of them. With it, megatron's
    ``DistributedOptimizer`` gives rank r the r-th of ``shard_group`` equal slices of every bucket, and
    keeps optimizer state only for the parameter elements inside its slice (padding has none).
    """
    if not distributed_optimizer:
        return sum(t.numel for t in tensors)
    per_rank = [0] * shard_group
    for b_start, b_end, params in buffer_buckets(tensors, shard_group, True, bucket_size):
        size = (b_end - b_start) // shard_group
        for p_start, p_end in params:
            first = (p_start - b_start) // size
            last = min(shard_group - 1, (p_end - 1 - b_start) // size)
            for r in range(first, last + 1):
                lo, hi = b_start + r * size, b_start + (r + 1) * size
                per_rank[r] += min(hi, p_end) - max(lo, p_start)
    return max(per_rank)
