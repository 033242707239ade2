"""Per-GPU memory of an SRPO run, phase by phase, and the layouts that fit.

Two phases share each GPU when the SGLang engine is colocated (``rollout.placement: colocated``):

- **train** (scoring + training passes): the policy's bf16 params in megatron DDP's buffer, fp32 gradient
  buffers (``grad_reduce_in_fp32``), the optimizer's fp32 main params and two Adam moments (sharded over
  DP×CP by the distributed optimizer; expert params over the expert-DP group), the EMA teacher (a bf16
  forward copy, same layout as the policy, plus its fp32 copy), the activations that 1F1B keeps in flight
  for the recipe's token budget, and the loss's logits working set on the last stage (with the fused
  output layer, ``performance.fused_output``, only chunk-sized buffers and the output weight's gradient
  accumulator: ``loss_logits_bytes``). The engine has
  released its weights and KV cache (``release_memory``) and keeps only its context.
- **rollout**: what the trainer keeps resident, plus the engine's weights and KV cache. SGLang sizes its
  KV pool as ``mem_fraction_static × GPU − (memory already taken)``, so whatever the trainer leaves on
  the GPU comes out of the KV cache; the plan refuses a KV cache smaller than one longest sequence.

Options (``PlanSettings``), and which the trainer implements today:

- implemented: ``tp``, ``pp`` (also layer counts it does not divide: the shared
  ``models.architecture.pipeline_stage_layers`` split), ``distributed_optimizer``, bf16/fp32 params,
  the EMA teacher with a full
  or DP-sharded fp32 copy (``teacher_fp32: full|sharded``, trainer/state/ema_shard.py), ``teacher_offload``
  (the bf16 teacher in host memory between its forwards) and ``offload_during_rollout`` (grads,
  optimizer state and teacher leave the GPU while the engine runs; trainer/state/offload.py, whose resident
  bytes per component equal this plan's, tests/dist/test_offload.py), colocated SGLang that releases its
  memory for training, SGLang engines on nodes of their own (``placement: separate``: their GPU is
  planned too, ``separate_engine_memory``), activation recompute (``recompute: none|full``;
  ``selective`` is planned as ``none``: an upper bound, the estimate already leaves out what
  core-attention recompute drops), ``sequence_parallel``, micro-batches padded to
  ``model.max_sequence_length``, ``cp`` (each rank holds 1/CP of every packed sequence; the trainer needs
  packing for it), ``ep``/``etp`` (MoE, trainer/microbatches/moe_replay.py), ``routing_replay`` (the
  replayed int64 expert ids of the micro-batches in flight, ``replay_ids``). The planner
  models only keys the trainer's ``TrainConfig`` accepts (tests/unit/test_planner_recipe.py).

Activations per layer and token follow what megatron's local layer spec saves for backward (measured
with saved-tensor hooks in tests/unit/test_planner.py): 6·H for the norms and residual branch (÷TP with
sequence parallelism), 5·q + 4·kv for attention (fused QKV output, q/k norms and RoPE, flash-style
attention output, output-projection input), 5·F for SwiGLU, all ÷TP; MoE layers replace 5·F with the
router's input and fp32 scores and, for each of the top-k routes, the permuted input, 5·Fe and the expert
output, plus 5·Fs for the shared experts (DeepSeek-V3, GLM-4.5). MLA layers (DeepSeek-V3): the latents of
the replicated down projections and their norms, then per head q, k, v, the attention output and the
projection input (0.9 of autograd's count on a tiny DeepSeek-V3; GLM-4.5's MoE 1.0, MoE at TP2 / EP2 under
sequence parallelism within 15%: tests/dist/test_planner_activations.py). Full recompute keeps each
layer's input plus one layer's working set during its backward.

The engine's KV cache follows SGLang's pools (``kv_bytes_per_token``): K and V per KV head, one latent per
token and layer for MLA, and the hybrid sliding-window pool for gpt-oss.
Transformer Engine fuses norms into the linears and saves a little less: the estimate is an upper bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Literal

from srpo_megatron.models.architecture import padded_vocab_size
from srpo_megatron.planner.model import (
    Layout,
    ModelShape,
    PlanError,
    buffer_numel,
    ddp_bucket_size,
    optimizer_shard_numel,
    param_tensors,
    stage_layers,
    stage_param_counts,
    total_params,
)

GiB = 1024**3
# One CUDA context + NCCL communicators per process (trainer, engine); measured ~0.5-1 GiB on H100.
CONTEXT_BYTES = 1 * GiB
# SGLang's CUDA graphs, sampler and decode activations, which live outside mem_fraction_static.
ENGINE_WORKSPACE_BYTES = 4 * GiB
# What a released SGLang engine still holds during training (torch_memory_saver pauses weights and KV).
ENGINE_RELEASED_BYTES = 1 * GiB
# One fp32 [chunk, V/TP] work buffer of the vocab-parallel kernels on accelerators
# (ops/vocab_parallel.DEFAULT_CHUNK_BYTES_ACCELERATOR); the kernels use three.
CHUNK_BUFFER_BYTES = 128 * 1024**2
LOSS_CHUNK_BYTES = 3 * CHUNK_BUFFER_BYTES
# [T, V/TP] tensors alive at the loss: the logits, their gathered rows, the masked rows and the gradient.
LOGITS_COPIES = 4
# SGLang's default ``swa_full_tokens_ratio`` (sglang/srt/arg_groups/fields/schedule.py): the SWA pool holds
# this share of the full pool's tokens.
SGLANG_SWA_FULL_TOKENS_RATIO = 0.8

Recompute = Literal["none", "selective", "full"]
TeacherFp32 = Literal["none", "full", "sharded"]


@dataclass(frozen=True)
class PlanSettings:
    """Everything of a recipe that decides memory (read by ``settings_from_recipe``)."""

    layout: Layout  # parallel layout of the trainer
    gpu_bytes: int  # memory of one GPU
    gpus_per_node: int = 8  # for "cross-node TP" in the ranking
    params_bytes: int = 2  # 2 = bf16 mixed precision (fp32 main params in the optimizer), 4 = fp32
    distributed_optimizer: bool = True  # shard main params and Adam state over DP (ZeRO-1)
    overlap_grad_reduce: bool = False  # megatron DDP buckets (with overlap) instead of one bucket per buffer
    sequence_parallel: bool = False  # megatron SP: norm/residual activations ÷ TP
    recompute: Recompute = "none"  # activation recompute
    micro_batch_size: int = 1  # sequences per micro-batch
    seq_len: int = 4096  # padded sequence length of a micro-batch (prompt + response)
    sequences_per_step: int = 256  # prompts × group size per optimizer step (all DP ranks)
    teacher: bool = True  # an EMA/frozen/trust-region teacher model exists (not for GRPO)
    teacher_fp32: TeacherFp32 = "full"  # the EMA teacher's fp32 copy: none, full, or sharded over DP
    teacher_offload: bool = False  # the bf16 teacher lives in host memory between its forwards
    offload_during_rollout: bool = False  # grads, optimizer and teacher leave the GPU during rollouts
    engine: Literal["none", "colocated", "separate"] = "colocated"  # where rollouts run
    engine_tp: int = 1  # SGLang tp_size (GPUs one engine spans)
    engine_mem_fraction: float = 0.6  # SGLang mem_fraction_static
    rollout_seq_len: int = 4096  # longest prompt + response the engine must hold in its KV cache
    # SGLang swa_full_tokens_ratio for sliding-window models (None: disable_hybrid_swa_memory, one pool)
    engine_swa_ratio: float | None = SGLANG_SWA_FULL_TOKENS_RATIO
    # the output layer fused into the loss kernels (performance.fused_output; no [T, V/TP] logits)
    fused_output: bool = False
    # rollout.routing_replay: the engine's expert ids are replayed (MoE; the int64 ids kept per micro-batch)
    routing_replay: bool = False
    # lora.rank > 0: (Architecture, LoraConfig) of the adapters; the base is frozen (``_lora_rows``)
    lora: tuple | None = None


@dataclass
class StageMemory:
    """Bytes per component of one pipeline stage, per phase."""

    stage: int
    train: dict[str, int] = field(default_factory=dict)
    rollout: dict[str, int] = field(default_factory=dict)
    resident: list[str] = field(default_factory=list)  # components on the GPU in both phases
    kv_tokens: int = 0  # tokens the engine's KV cache holds on this GPU's engine
    replay: dict | None = None  # routing replay's expert-id terms (``replay_ids``), None without replay

    @property
    def peak(self) -> int:
        return max(sum(self.train.values()), sum(self.rollout.values()))

    @property
    def peak_phase(self) -> str:
        return "train" if sum(self.train.values()) >= sum(self.rollout.values()) else "rollout"


@dataclass
class Plan:
    """The planner's verdict for one layout."""

    model: str
    layout: Layout
    settings: PlanSettings
    policy_params: int  # unsharded parameter count of the policy
    stage: StageMemory  # the worst pipeline stage
    gpu_bytes: int
    problems: list[str]  # why it does not fit (empty when it fits)
    shape: ModelShape | None = None  # the planned model
    engine_gpu: dict[str, int] = field(default_factory=dict)  # a separate engine's GPU: bytes per component
    engine_kv_tokens: int = 0  # tokens a separate engine's KV cache holds per GPU
    # with the fused output layer: the last stage's loss working set (materialised, fused) in bytes
    fused_loss_logits: tuple[int, int] | None = None

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def peak_bytes(self) -> int:
        return self.stage.peak

    @property
    def overflow(self) -> str | None:
        """The component at which the peak phase's running total (in table order) passes the GPU's memory."""
        comps = self.stage.train if self.stage.peak_phase == "train" else self.stage.rollout
        running = 0
        for name, b in comps.items():
            running += b
            if running > self.gpu_bytes:
                return name
        return None

    def to_json(self) -> dict:
        return {
            "fits": self.fits,
            "model": self.model,
            "layout": self.layout.label(),
            "peak_bytes": self.peak_bytes,
            "gpu_bytes": self.gpu_bytes,
            "policy_params": self.policy_params,
            "worst_stage": self.stage.stage,
            "peak_phase": self.stage.peak_phase,
            "components": {"train": self.stage.train, "rollout": self.stage.rollout},
            "resident": self.stage.resident,
            "kv_cache_tokens": self.stage.kv_tokens,
            "replay_expert_ids": self.stage.replay,
            "separate_engine_gpu": self.engine_gpu,
            "separate_engine_kv_tokens": self.engine_kv_tokens,
            "overflow": self.overflow,
            "fused_output_loss_logits": None
            if self.fused_loss_logits is None
            else dict(zip(("materialised_bytes", "fused_bytes"), self.fused_loss_logits, strict=True)),
            "problems": self.problems,
        }


def layer_activation_elements(shape: ModelShape, layout: Layout, sp: bool, moe: bool) -> tuple[float, float]:
    """(elements in the params dtype, fp32 elements) one layer saves per token of a micro-batch."""
    tp, h = layout.tp, shape.hidden_size
    seq = tp if sp else 1  # what sequence parallelism splits
    if shape.is_mla:
        # MLA (roughly): the replicated down projections' latents and their norms (split by SP, as their
        # input), then per head q, k (RoPE part broadcast), v, the attention output and the projection input.
        heads, hd, d_v = shape.num_heads, shape.head_dim, shape.v_head_dim
        latents = 2 * shape.q_lora_rank + 2 * (shape.kv_lora_rank + shape.qk_rope_head_dim)
        main = 6 * h / seq + latents / seq + heads * (4 * hd + (hd - shape.qk_rope_head_dim) + 3 * d_v) / tp
        fp32 = 4 + heads / tp  # norm rstd's (two latent norms too), attention log-sum-exp
    else:
        q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
        main = 6 * h / seq + (5 * q + 4 * kv) / tp
        fp32 = 2 + (2 * shape.num_heads + shape.num_kv_heads) / tp  # norm rstd's, attention log-sum-exp
    if moe:
        # Under sequence parallelism each TP rank routes its own s/TP tokens (megatron folds TP into the
        # expert-parallel group) and an expert-TP group gathers its ETP ranks' tokens: ETP/TP of them.
        routed = layout.etp / tp if sp else 1.0
        fe = shape.moe_ffn_hidden_size / layout.etp
        main += h / seq + routed * shape.moe_topk * (2 * h + 5 * fe)
        main += 5 * shape.shared_ffn_hidden_size / tp  # the shared experts: a dense SwiGLU
        fp32 += 2 * shape.num_experts / seq  # router logits and probabilities of this rank's tokens
    else:
        main += 5 * shape.ffn_hidden_size / tp
    return main, fp32


def activation_bytes(
    shape: ModelShape,
    layout: Layout,
    stage: int,
    tokens: int,
    settings: PlanSettings,
    in_flight: int,
    backward_working_set: bool = True,
) -> int:
    """Activations stage ``stage`` holds at its peak: ``in_flight`` micro-batches of ``tokens`` tokens.

    ``backward_working_set``: with full recompute, add the one layer recomputed during its backward (off:
    only what the forward saves, which is what saved-tensor hooks see).
    """
    layers = stage_layers(shape.num_layers, layout.pp)
    first = sum(layers[:stage])
    b, sp = settings.params_bytes, settings.sequence_parallel
    h_shard = shape.hidden_size / (layout.tp if sp else 1)
    per_layer = []
    for i in range(first, first + layers[stage]):
        main, fp32 = layer_activation_elements(shape, layout, sp, shape.is_moe_layer(i))
        per_layer.append(tokens * (main * b + fp32 * 4))
    if settings.recompute == "full":
        saved = layers[stage] * tokens * h_shard * b
        working = max(per_layer) if backward_working_set else 0.0  # one layer recomputed in backward
    else:
        saved, working = sum(per_layer), 0.0
    extra = 0.0
    if stage == 0:
        extra += tokens * (h_shard * b + 8)  # embedding output, token ids
    if stage == layout.pp - 1:
        extra += tokens * (2 * h_shard * b + 4)  # final norm input/output, rstd
    return int(in_flight * (saved + extra) + working)


def loss_logits_bytes(shape: ModelShape, layout: Layout, tokens: int, params_bytes: int, fused: bool) -> int:
    """The last stage's loss working set for a micro-batch of ``tokens`` rows, at its peak.

    Materialised (``fused=False``): ``LOGITS_COPIES`` [T, V/TP] tensors plus the kernels' work buffers.
    Fused (``ops/fused_output.py``), peak in the training pass's backward: the fp32 weight-gradient
    accumulator [V/TP, H] and the hidden-state gradient [T, H] (both allocated when backward starts), plus
    the larger of (a) the chunk loop's three fp32 work buffers and, for half-precision weights, the GEMM's
    half-precision block, the block's fp32 ∂L/∂logits and its rounding to the weight dtype, and (b) after
    the loop, the accumulator rounded to the weight's dtype. The scoring and teacher passes (forward only)
    need less.
    """
    v_shard = padded_vocab_size(shape.vocab_size, layout.tp) // layout.tp
    if not fused:
        return LOGITS_COPIES * tokens * v_shard * params_bytes + LOSS_CHUNK_BYTES
    chunk = min(tokens, max(1, CHUNK_BUFFER_BYTES // (4 * v_shard))) * v_shard
    half = params_bytes != 4
    # half precision: the block's logits in the weight dtype, its fp32 gradient, that gradient rounded for
    # the hidden-state GEMM (fp32 weights write the gradient over the logits: nothing more)
    loop = 3 * 4 * chunk + ((2 * params_bytes + 4) * chunk if half else 0)
    weight = v_shard * shape.hidden_size
    rounded = params_bytes * weight if half else 0
    return 4 * weight + tokens * shape.hidden_size * params_bytes + max(loop, rounded)


def plan_layout(shape: ModelShape, s: PlanSettings, exact: bool = True) -> Plan:
    """Memory of every pipeline stage of ``s.layout``; the worst stage decides.

    ``exact=False`` leaves out megatron's buffer padding: a lower bound on every component (and an upper
    bound on the KV cache), cheap enough to rule layouts out during the search.
    """
    layout = s.layout
    layout.check(shape)
    problems: list[str] = []
    if s.seq_len % (2 * layout.cp) and layout.cp > 1:
        problems.append(f"seq_len {s.seq_len} is not divisible by 2·CP = {2 * layout.cp}")
    tokens = math.ceil(s.micro_batch_size * s.seq_len / layout.cp)
    per_dp = math.ceil(s.sequences_per_step / layout.dp)
    micro_batches = max(1, math.ceil(per_dp / s.micro_batch_size))
    cache: dict = {"exact": exact}
    stages = [_stage_memory(shape, s, st, tokens, micro_batches, cache) for st in range(layout.pp)]
    worst = max(stages, key=lambda m: m.peak)
    if worst.peak > s.gpu_bytes:
        problems.append(
            f"{worst.peak_phase} phase needs {worst.peak / GiB:.1f} GiB on stage {worst.stage}, the GPU has "
            f"{s.gpu_bytes / GiB:.1f} GiB"
        )
    if s.engine == "colocated" and worst.kv_tokens < s.rollout_seq_len:
        problems.append(
            f"the engine's KV cache holds {worst.kv_tokens} tokens, less than one sequence of "
            f"{s.rollout_seq_len}: raise mem_fraction_static or the engine's tp_size, or offload during "
            "rollouts"
        )
    engine_gpu, engine_kv = separate_engine_memory(shape, s) if s.engine == "separate" else ({}, 0)
    fused_logits = None
    if s.fused_output:
        fused_logits = (
            loss_logits_bytes(shape, layout, tokens, s.params_bytes, fused=False),
            stages[-1].train["loss logits + chunks"],
        )
    if engine_gpu and (engine_kv < s.rollout_seq_len or sum(engine_gpu.values()) > s.gpu_bytes):
        problems.append(
            f"a separate engine of tp_size {s.engine_tp} holds {engine_gpu['engine weights'] / GiB:.1f} GiB "
            f"of bf16 weights per GPU and {engine_kv} KV tokens (mem_fraction_static "
            f"{s.engine_mem_fraction}), less than one sequence of {s.rollout_seq_len} or more than the "
            f"GPU's {s.gpu_bytes / GiB:.1f} GiB: raise the engine's tp_size or mem_fraction_static"
        )
    return Plan(
        shape.name,
        layout,
        s,
        total_params(shape),
        worst,
        s.gpu_bytes,
        problems,
        shape,
        engine_gpu,
        engine_kv,
        fused_logits,
    )


def separate_engine_memory(shape: ModelShape, s: PlanSettings) -> tuple[dict[str, int], int]:
    """(bytes per component, KV tokens) of one GPU of an SGLang engine on nodes of its own
    (``rollout.placement: separate``): SGLang takes ``mem_fraction_static`` of the GPU for its weights and
    KV pool, so the pool is what the bf16 weights (1/tp_size of the model) leave of it."""
    weights = engine_weight_bytes(shape, s.engine_tp)
    kv = max(0, int(s.engine_mem_fraction * s.gpu_bytes) - weights)
    parts = {
        "engine weights": weights,
        "engine KV cache": kv,
        "engine workspace": ENGINE_WORKSPACE_BYTES,
        "CUDA contexts": CONTEXT_BYTES,
    }
    return parts, kv // kv_bytes_per_token(shape, s.engine_tp, s.engine_swa_ratio)


def _buffers(shape: ModelShape, s: PlanSettings, stage: int, exact: bool = True) -> tuple[int, int]:
    """(dense, expert) DDP buffer elements of pipeline stage ``stage`` (not exact: without padding)."""
    layout = s.layout
    if not exact:  # unpadded: a lower bound on both
        dense, expert = stage_param_counts(shape, layout, stage)
        if not s.distributed_optimizer:
            return dense + expert, dense + expert
        return dense + expert, dense // layout.dense_shard_group + expert // max(1, layout.expert_dp)
    tensors = param_tensors(shape, layout, stage)
    dense = [t for t in tensors if not t.expert]
    expert = [t for t in tensors if t.expert]
    bucket = ddp_bucket_size(layout.dense_shard_group, s.overlap_grad_reduce)
    dist_opt = s.distributed_optimizer
    buf = buffer_numel(dense, layout.dense_shard_group, dist_opt, bucket)
    buf += buffer_numel(expert, layout.expert_dp, dist_opt, bucket) if expert else 0
    opt = optimizer_shard_numel(dense, layout.dense_shard_group, dist_opt, bucket)
    opt += optimizer_shard_numel(expert, layout.expert_dp, dist_opt, bucket) if expert else 0
    return buf, opt


def replay_ids(shape: ModelShape, layout: Layout, stage: int, tokens: int, sp: bool, in_flight: int) -> dict:
    """Routing replay's expert ids on stage ``stage`` (``compat/router_replay.py``): int64 ``[tokens, k]``
    per MoE layer (the index megatron's ``scores.gather`` takes) for each micro-batch between its forward
    and its backward, ``tokens`` the micro-batch's tokens on this rank (÷ TP under sequence parallelism).
    Kept for the backward recompute with recompute, held by autograd as the gather's index without; freed
    with the micro-batch's backward either way. Returns the terms and their product ``bytes``."""
    layers = stage_layers(shape.num_layers, layout.pp)
    first = sum(layers[:stage])
    terms = dict(
        router_tokens=math.ceil(tokens / (layout.tp if sp else 1)),
        moe_layers=sum(shape.is_moe_layer(i) for i in range(first, first + layers[stage])),
        top_k=shape.moe_topk,
        id_bytes=8,
        in_flight=in_flight,
    )
    return {**terms, "bytes": math.prod(terms.values())}


def _stage_memory(
    shape: ModelShape,
    s: PlanSettings,
    stage: int,
    tokens: int,
    micro_batches: int,
    cache: dict | None = None,
) -> StageMemory:
    layout = s.layout
    # Stages with the same layers and the same ends hold the same tensors: count them once.
    layers = stage_layers(shape.num_layers, layout.pp)
    first = sum(layers[:stage])
    moe = tuple(shape.is_moe_layer(i) for i in range(first, first + layers[stage]))
    key = (stage == 0, stage == layout.pp - 1, moe)
    cache = {} if cache is None else cache
    if key not in cache:
        cache[key] = _buffers(shape, s, stage, cache.get("exact", True))
    numel, opt_elems = cache[key]
    opt_per_param = 12 if s.params_bytes == 2 else 8  # fp32 main + exp_avg + exp_avg_sq (fp32: moments)
    fp32_copy = {"none": 0, "full": 4 * numel, "sharded": 4 * opt_elems}[s.teacher_fp32] if s.teacher else 0
    m = StageMemory(stage)
    t = m.train
    t["policy params"] = s.params_bytes * numel
    t["gradient buffers"] = 4 * numel
    t["optimizer (fp32 main + Adam)"] = opt_per_param * opt_elems
    t["teacher bf16 copy"] = s.params_bytes * numel if s.teacher else 0
    t["teacher fp32 copy"] = fp32_copy
    if s.lora is not None:
        t.update(_lora_rows(shape, s, stage, cache))
    in_flight = min(layout.pp - stage, micro_batches)
    t["activations"] = activation_bytes(shape, layout, stage, tokens, s, in_flight)
    if s.routing_replay and shape.is_moe:
        m.replay = replay_ids(shape, layout, stage, tokens, s.sequence_parallel, in_flight)
        t["replay expert ids"] = m.replay["bytes"]
    last = stage == layout.pp - 1
    t["loss logits + chunks"] = (
        loss_logits_bytes(shape, layout, tokens, s.params_bytes, s.fused_output) if last else 0
    )
    t["engine (released)"] = ENGINE_RELEASED_BYTES if s.engine == "colocated" else 0
    t["CUDA contexts"] = CONTEXT_BYTES * (2 if s.engine == "colocated" else 1)

    # Rollout phase: what the trainer keeps, then the engine.
    offloaded = {"gradient buffers", "optimizer (fp32 main + Adam)", "teacher bf16 copy", "teacher fp32 copy"}
    if not s.offload_during_rollout:
        offloaded = {"teacher bf16 copy"} if s.teacher_offload else set()
    keep = ["policy params", "gradient buffers", "optimizer (fp32 main + Adam)", "teacher bf16 copy"]
    keep.append("teacher fp32 copy")
    r = m.rollout
    for name in keep:
        r[name] = 0 if name in offloaded else t[name]
    if s.lora is not None:
        r["teacher bf16 copy"] = 0  # LoRA: the adapters saved during the teacher's forward only
    m.resident = [n for n in keep if r[n] > 0]
    r["CUDA contexts"] = t["CUDA contexts"]
    if s.engine == "colocated":
        weights = engine_weight_bytes(shape, s.engine_tp)
        taken = sum(r.values())
        kv = max(0, int(s.engine_mem_fraction * s.gpu_bytes) - taken - weights)
        r["engine weights"] = weights
        r["engine KV cache"] = kv
        r["engine workspace"] = ENGINE_WORKSPACE_BYTES
        m.kv_tokens = kv // kv_bytes_per_token(shape, s.engine_tp, s.engine_swa_ratio)
    return m


def _lora_rows(shape: ModelShape, s: PlanSettings, stage: int, cache: dict) -> dict[str, int]:
    """The policy and teacher rows of a LoRA run (``lora.rank > 0``), as trainer/state/policy.py builds it.

    ``models/lora.attach_lora`` freezes the base before megatron's DDP wraps the model, so the base weights
    stay in the params dtype outside DDP's buffers: no gradient, no fp32 main copy, no Adam state
    (``teacher.fp32_main_params`` reads a frozen parameter as itself). The ``n`` adapter values of the stage
    (``planner/lora.stage_adapter_values``) are the only trained parameters: params dtype in the buffer,
    fp32 gradients, fp32 main + moments over the DP×CP group with the distributed optimizer (an upper
    bound for expert adapters, which shard over the smaller of it and expert DP). The teacher
    (``trainer/state/adapter_teacher.py``) keeps an fp32 copy of the adapters (EMA, or frozen) and, only
    while its forward runs, the student's adapters it swapped out ("teacher bf16 copy"). Buffer padding is
    left out (at most one bucket's DP multiple).
    """
    from srpo_megatron.planner.lora import stage_adapter_values

    layout = s.layout
    key = ("lora", layout.tp, layout.pp, layout.ep, layout.etp)
    if key not in cache:
        arch, lora = s.lora
        cache[key] = stage_adapter_values(arch, lora, layout.tp, layout.pp, layout.ep, layout.etp)
    n = cache[key][stage]
    shard = 1
    if s.distributed_optimizer:
        shard = layout.dense_shard_group
        if shape.is_moe and s.lora[1].experts:
            shard = min(shard, max(1, layout.expert_dp))
    opt_per_param = 12 if s.params_bytes == 2 else 8
    return {
        "policy params": s.params_bytes * (sum(stage_param_counts(shape, layout, stage)) + n),
        "gradient buffers": 4 * n,
        "optimizer (fp32 main + Adam)": opt_per_param * math.ceil(n / shard),
        "teacher bf16 copy": s.params_bytes * n if s.teacher else 0,
        "teacher fp32 copy": 4 * n if s.teacher else 0,
    }


def engine_weight_bytes(shape: ModelShape, engine_tp: int) -> int:
    """bf16 weight bytes of one engine GPU: the model over ``tp_size`` GPUs, except what SGLang replicates
    on every rank: MLA's latent down projections (``fused_qkv_a_proj_with_mqa``, a ``ReplicatedLinear`` in
    sglang/srt/models/deepseek_v2.py) with their norms, and every MoE layer's router (``MoEGate``)."""
    replicated = 0
    if shape.is_mla:
        latent = shape.q_lora_rank + shape.kv_lora_rank + shape.qk_rope_head_dim
        replicated += shape.num_layers * (latent * shape.hidden_size + shape.q_lora_rank + shape.kv_lora_rank)
    if shape.is_moe:
        moe_layers = sum(shape.is_moe_layer(i) for i in range(shape.num_layers))
        replicated += moe_layers * shape.num_experts * shape.hidden_size
    return 2 * ((total_params(shape) - replicated) // engine_tp + replicated)


def kv_bytes_per_token(shape: ModelShape, engine_tp: int, swa_ratio: float | None = None) -> int:
    """bf16 KV-cache bytes per token of the engine's (full) pool on one engine GPU, by SGLang's pools.

    - Standard attention (SGLang ``MHATokenToKVPool``, sglang/srt/mem_cache/memory_pool.py): K and V of
      every layer, ``2 · kv_heads/TP · head_dim`` values (KV heads replicated when TP > heads).
    - MLA (DeepSeek-V3; SGLang ``MLATokenToKVPool`` in the same file): ONE latent per token and layer,
      ``kv_lora_rank + qk_rope_head_dim`` values (512 + 64 = 576), not per head, and the same on every TP
      rank (the latent is not split by heads; SGLang's DP attention, which would divide it, is not
      planned).
    - Sliding-window layers (gpt-oss, which SGLang treats as a hybrid-SWA architecture: ``SWAKVPool``,
      sglang/srt/mem_cache/swa_memory_pool.py, sized in sglang/srt/model_executor/pool_configurator.py):
      each full token costs its full layers' KV plus ``swa_ratio`` (``swa_full_tokens_ratio``, default 0.8)
      times the sliding layers' KV, since the SWA pool holds that share of the full pool's tokens.
      ``swa_ratio=None`` (``disable_hybrid_swa_memory``) keeps every layer in the full pool.
    """
    if shape.is_mla:
        return shape.num_layers * (shape.kv_lora_rank + shape.qk_rope_head_dim) * 2
    heads = max(1, shape.num_kv_heads // engine_tp)
    per_layer = 2 * heads * shape.head_dim * 2
    sliding = sum(shape.is_sliding_layer(i) for i in range(shape.num_layers))
    if swa_ratio is None:
        return shape.num_layers * per_layer
    return int((shape.num_layers - sliding) * per_layer + swa_ratio * sliding * per_layer)


def candidate_layouts(shape: ModelShape, world: int, gpus_per_node: int, seq_len: int) -> list[Layout]:
    """Every layout megatron can build on ``world`` GPUs (TP within a node)."""
    out = []
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    for tp in [d for d in divisors if d <= gpus_per_node and shape.num_kv_heads % d == 0]:
        for pp in [d for d in divisors if d <= shape.num_layers and (world // tp) % d == 0]:
            for cp in [c for c in (1, 2, 4, 8) if (world // (tp * pp)) % c == 0 and seq_len % (2 * c) == 0]:
                dp = world // (tp * pp * cp)
                eps = [1]
                if shape.is_moe:
                    eps = [e for e in divisors if shape.num_experts % e == 0 and (world // pp) % e == 0]
                for ep in eps:
                    layout = Layout(tp=tp, pp=pp, cp=cp, dp=dp, ep=ep)
                    try:
                        layout.check(shape)
                    except PlanError:
                        continue
                    out.append(layout)
    return out


def rank_key(plan: Plan) -> tuple:
    """Fewest PP stages, then least CP, TP and EP (i.e. most data parallelism), then the lowest peak."""
    lay = plan.layout
    return (lay.pp, lay.cp, lay.tp, lay.ep, plan.peak_bytes)


def fitting_layouts(shape: ModelShape, settings: PlanSettings, world: int, limit: int = 5) -> list[Plan]:
    """The first ``limit`` layouts that fit on ``world`` GPUs, best first by ``rank_key``.

    Candidates are tried in ranking order (the layout alone decides it), so the search stops early.
    """
    plans = []
    candidates = candidate_layouts(shape, world, settings.gpus_per_node, settings.seq_len)
    for layout in sorted(candidates, key=lambda lay: (lay.pp, lay.cp, lay.tp, lay.ep)):
        if not plan_layout(shape, replace(settings, layout=layout), exact=False).fits:
            continue  # even without padding it does not fit
        plan = plan_layout(shape, replace(settings, layout=layout))
        if plan.fits:
            plans.append(plan)
            if len(plans) == limit:
                break
    return sorted(plans, key=rank_key)


__all__ = [
    "GiB",
    "Plan",
    "PlanError",
    "PlanSettings",
    "StageMemory",
    "fitting_layouts",
    "loss_logits_bytes",
    "plan_layout",
]
