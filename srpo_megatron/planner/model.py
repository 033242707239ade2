"""What one rank of a megatron GPTModel holds: model shape, parallel layout and parameter tensors.

``ModelShape.from_hf`` reads a dense Qwen3/Qwen2/Llama config (validated by :class:`Architecture`) or a
Qwen3-MoE config (``num_experts``, ``moe_intermediate_size``, ``num_experts_per_tok``,
``decoder_sparse_step``, ``mlp_only_layers``). ``param_tensors(shape, layout, stage)`` lists the numel
of every parameter tensor that pipeline stage ``stage`` builds on one rank, in megatron-core's layout:

- attention: fused QKV ``[(q + 2kv)/TP, H]`` (+ bias), output ``[H, q/TP]``, QK-norm weights ``[hd]``;
- dense MLP: SwiGLU fc1 ``[2F/TP, H]`` and fc2 ``[H, F/TP]``;
- MoE MLP: router ``[E, H]`` (replicated), and ``E/EP`` local experts of fc1 ``[2Fe/ETP, H]`` and fc2
  ``[H, Fe/ETP]`` (expert-parallel params: reduced and sharded over the expert-data-parallel group);
- embedding ``[V_pad/TP, H]`` on the first stage, output layer ``[V_pad/TP, H]`` and final norm on the
  last (also when embeddings are tied and PP > 1: megatron keeps a synced copy there).

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


def param_tensors(shape: ModelShape, layout: Layout, stage: int) -> list[ParamTensor]:
    """Every parameter tensor pipeline stage ``stage`` holds on one rank (TP/EP/ETP-sharded sizes), in the
    order of megatron's ``named_parameters()`` (which decides DDP bucket boundaries)."""
    tp, h, hd = layout.tp, shape.hidden_size, shape.head_dim
    q, kv = shape.num_heads * hd, shape.num_kv_heads * hd
    layers = stage_layers(shape.num_layers, layout.pp)
    first_layer = sum(layers[:stage])
    v_pad = padded_vocab_size(shape.vocab_size, tp)
    out: list[ParamTensor] = []
    if stage == 0:
        out.append(ParamTensor(v_pad // tp * h, shared=shape.tie_embeddings))
    for i in range(first_layer, first_layer + layers[stage]):
        # megatron's parameter order: input norm, attention output, fused QKV (+ bias), q/k norms, MLP norm
        out += [ParamTensor(h), ParamTensor(h * (q // tp)), ParamTensor((q + 2 * kv) // tp * h)]
        if shape.qkv_bias:
            out.append(ParamTensor((q + 2 * kv) // tp))
        if shape.qk_norm:
            out += [ParamTensor(hd), ParamTensor(hd)]
        out.append(ParamTensor(h))
        if shape.is_moe_layer(i):
            fe = shape.moe_ffn_hidden_size // layout.etp
            out.append(ParamTensor(shape.num_experts * h))  # router (dense: replicated over TP)
            for _ in range(shape.num_experts // layout.ep):
                out += [ParamTensor(2 * fe * h, True), ParamTensor(h * fe, True)]
        else:
            f = shape.ffn_hidden_size // tp
            out += [ParamTensor(2 * f * h), ParamTensor(h * f)]
    if stage == layout.pp - 1:
        out.append(ParamTensor(h))  # final norm
        if not (shape.tie_embeddings and layout.pp == 1):
            out.append(ParamTensor(v_pad // tp * h, shared=shape.tie_embeddings))
    return out


def stage_param_counts(shape: ModelShape, layout: Layout, stage: int) -> tuple[int, int]:
    """(dense, expert) parameter elements of a stage, by arithmetic (equals summing ``param_tensors``)."""
    tp, h, hd = layout.tp, shape.hidden_size, shape.head_dim
    q, kv = shape.num_heads * hd, shape.num_kv_heads * hd
    layers = stage_layers(shape.num_layers, layout.pp)
    first = sum(layers[:stage])
    v_rows = padded_vocab_size(shape.vocab_size, tp) // tp
    attn = 2 * h + h * (q // tp) + (q + 2 * kv) // tp * h
    attn += (q + 2 * kv) // tp if shape.qkv_bias else 0
    attn += 2 * hd if shape.qk_norm else 0
    dense = expert = 0
    for i in range(first, first + layers[stage]):
        dense += attn
        if shape.is_moe_layer(i):
            dense += shape.num_experts * h
            expert += shape.num_experts // layout.ep * 3 * (shape.moe_ffn_hidden_size // layout.etp) * h
        else:
            dense += 3 * (shape.ffn_hidden_size // tp) * h
    if stage == 0:
        dense += v_rows * h
    if stage == layout.pp - 1:
        dense += h + (0 if shape.tie_embeddings and layout.pp == 1 else v_rows * h)
    return dense, expert


@functools.lru_cache(maxsize=64)
def total_params(shape: ModelShape) -> int:
    """Unsharded parameter count of the model (HF vocabulary, tied embeddings counted once)."""
    dense, expert = stage_param_counts(shape, Layout(), 0)
    padding_rows = padded_vocab_size(shape.vocab_size, 1) - shape.vocab_size
    return dense + expert - padding_rows * shape.hidden_size * (1 if shape.tie_embeddings else 2)


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
