"""Checks `srpo train` runs before loading the model, so bad input fails in seconds with one line.

- :func:`check_before_model`: the checks below that need only the recipe and the model's ``config.json``,
  in the order `srpo train` runs them.
- :func:`read_model_config`: the policy's ``config.json``, or one line naming it when it is missing, not
  JSON or not an object.
- :func:`check_model_limits`: ``loss.top_k`` within the vocabulary, ``model.max_sequence_length`` at least
  the longest prompt + response a rollout can make (``data.max_prompt_tokens + rollout.max_new_tokens``)
  and at most the model's ``max_position_embeddings``.
- :func:`check_layout`: the world divides into TP × PP × CP × DP and the model and batch divide over them
  (heads and KV groups over TP, layers over PP, experts over EP once the recipe has ``parallel.ep``, the
  step's samples over mini-batches × DP).
- :func:`check_attention_cp`: context parallelism with gpt-oss's learnable attention sinks only with
  ``parallel.cp_comm_type: a2a`` (Transformer Engine's fused attention takes sinks only with the all-to-all
  CP exchange; otherwise it drops to unfused attention), and a2a only where the heads split over CP.
- :func:`check_replay_config`: ``rollout.routing_replay`` only for an MoE model (any recompute: the
  experts are replayed in the backward recompute too, ``compat/router_replay.py``).
- :func:`check_recompute_modules`: selective recompute of ``moe`` / ``moe_act`` only for an MoE model,
  ``moe_act`` only with grouped-GEMM experts (megatron-core recomputes it there only).
- :func:`check_rewards`: every reward target the data needs is imported, its signature checked (it must
  take ``(response, answer)``: ``os:system`` is refused before it is called), and called once on a dummy
  input, with a timeout, by the reward pool the run will score with (rank 0's worker processes); a dummy
  call that raises is printed as a note, one that returns a non-number is refused.
- :func:`data_summary`: the one line that says how many rows were read, skipped, dropped, truncated.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from srpo_megatron.config import ConfigError
from srpo_megatron.conversion.output_guard import check_conversion_sizes
from srpo_megatron.models.architecture import Architecture, pipeline_stage_layers
from srpo_megatron.rollout.served_precision import check_served_precision


def check_before_model(cfg: Any, world_size: int) -> None:
    """`srpo train`'s checks before megatron or the model: the model's ``config.json`` readable, the model
    limits, the parallel layout over ``world_size`` processes, MoE expert replay, then the served folder's
    quantization against ``rollout.precision`` (before any engine starts)."""
    hf_config = read_model_config(cfg.model.hf_dir)  # one line for a missing or broken config.json
    check_model_limits(cfg, hf_config)  # top-K within the vocabulary, sequence budget within positions
    check_layout(cfg, world_size, hf_config)
    check_attention_cp(cfg, hf_config)
    arch = Architecture.from_hf(cfg.model.hf_dir)
    check_replay_config(cfg, arch)  # replay: an MoE model
    check_recompute_modules(cfg, arch)  # moe / moe_act recompute: an MoE model, grouped GEMM for moe_act
    check_served_precision(cfg)  # the served folder's quantization is one the weight sync can produce


def read_model_config(hf_dir: str) -> dict[str, Any]:
    """The HF ``config.json`` of ``model.hf_dir`` (a folder or the file itself) as a dict, or a one-line
    ConfigError naming the file."""
    path = Path(hf_dir).expanduser()
    if path.is_dir():
        check_conversion_sizes(path)  # a converter output whose files changed size: one line, first
    path = path / "config.json" if path.is_dir() else path
    if not path.is_file():
        raise ConfigError(
            f"model.hf_dir {hf_dir}: {path} does not exist; point model.hf_dir at an HF model folder "
            "(config.json + tokenizer + safetensors)"
        )
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(
            f"{path}: the model's config.json is not valid JSON ({e}); restore it (save_pretrained or a "
            "fresh download writes it)"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: the model's config.json must be a JSON object, got {type(data).__name__}; restore it"
        )
    return data


def check_model_limits(cfg: Any, hf_config: dict) -> None:
    """Refuse ``loss.top_k`` above the vocabulary and a ``model.max_sequence_length`` below the rollout
    budget or above the model's ``max_position_embeddings`` (before the model loads)."""
    where = f"model.hf_dir {cfg.model.hf_dir}"
    text = hf_config.get("text_config") or {}
    vocab = hf_config.get("vocab_size") or text.get("vocab_size")
    if vocab and cfg.loss.top_k > int(vocab):
        raise ConfigError(
            f"loss.top_k={cfg.loss.top_k} is larger than the vocabulary of {where} ({vocab} tokens); set "
            f"loss.top_k <= {vocab} (the paper: 100)"
        )
    seq, prompt, new = cfg.model.max_sequence_length, cfg.data.max_prompt_tokens, cfg.rollout.max_new_tokens
    if seq < prompt + new:
        raise ConfigError(
            f"model.max_sequence_length={seq} is below data.max_prompt_tokens + rollout.max_new_tokens = "
            f"{prompt} + {new} = {prompt + new}, the longest prompt + response a rollout can make; set "
            f"model.max_sequence_length >= {prompt + new} or lower those budgets"
        )
    positions = hf_config.get("max_position_embeddings") or text.get("max_position_embeddings")
    if positions and seq > int(positions):
        raise ConfigError(
            f"model.max_sequence_length={seq} is above the max_position_embeddings={positions} of {where}; "
            f"set model.max_sequence_length <= {positions} (and the prompt and response budgets within it)"
        )


def check_layout(cfg: Any, world_size: int, hf_config: dict) -> None:
    """Refuse a parallel layout the world, the model or the batch cannot be split into."""
    tp, pp, cp = cfg.parallel.tp, cfg.parallel.pp, getattr(cfg.parallel, "cp", 1)
    if world_size % (tp * pp * cp):
        cp_part = f" × parallel.cp={cp}" if cp > 1 else ""
        raise ConfigError(
            f"{world_size} processes cannot be split into parallel.tp={tp} × parallel.pp={pp}{cp_part}; "
            f"launch a multiple of {tp * pp * cp} processes or change tp/pp/cp"
        )
    dp = world_size // (tp * pp * cp)  # CP ranks of a replica share its samples
    heads = hf_config.get("num_attention_heads")
    kv = hf_config.get("num_key_value_heads") or heads
    layers = hf_config.get("num_hidden_layers")
    experts = hf_config.get("num_experts") or hf_config.get("num_local_experts")
    checks = [
        (heads, tp, "attention heads", "parallel.tp"),
        (kv, tp, "key/value heads (GQA groups)", "parallel.tp"),
        (experts, getattr(cfg.parallel, "ep", 1), "experts", "parallel.ep"),
    ]
    for count, size, what, key in checks:
        if count and size > 1 and count % size:
            raise ConfigError(
                f"model.hf_dir {cfg.model.hf_dir}: {count} {what} do not divide by {key}={size}; pick a "
                f"{key} that divides {count}"
            )
    if layers:  # PP need not divide the layers: the first and last stages take fewer (pipeline_stage_layers)
        try:
            pipeline_stage_layers(layers, pp)
        except ValueError as e:
            raise ConfigError(f"model.hf_dir {cfg.model.hf_dir}: {e}; change parallel.pp") from None
    samples = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    parts = cfg.train.mini_batches * dp
    if samples % parts:
        raise ConfigError(
            f"rollout.prompts_per_step × rollout.group_size = {samples} samples per step do not split into "
            f"train.mini_batches={cfg.train.mini_batches} × data-parallel size {dp} (= {world_size} "
            f"processes / (tp={tp} × pp={pp} × cp={cp})); make the samples a multiple of {parts}"
        )


def check_attention_cp(cfg: Any, hf_config: dict) -> None:
    """Refuse ``parallel.cp`` > 1 with learnable attention sinks (gpt-oss) unless ``parallel.cp_comm_type``
    is ``a2a``: Transformer Engine's ``FusedAttention`` supports ``softmax_type`` learnable under context
    parallelism only with the all-to-all exchange, and TE picks unfused attention (O(S^2) memory) rather
    than fail. a2a splits the heads of each TP rank over CP, so those must divide."""
    par = cfg.parallel
    cp, comm = getattr(par, "cp", 1), getattr(par, "cp_comm_type", "p2p")
    if cp == 1:
        return
    sinks = hf_config.get("model_type") == "gpt_oss"  # Architecture.from_hf: gpt-oss always has sinks
    if sinks and comm != "a2a":
        raise ConfigError(
            f"parallel.cp={cp} with parallel.cp_comm_type={comm}: model.hf_dir {cfg.model.hf_dir} has "
            "learnable attention sinks (gpt-oss), which Transformer Engine's fused attention takes under "
            "context parallelism only with the all-to-all exchange (it falls back to unfused attention "
            "otherwise); set parallel.cp_comm_type: a2a, or parallel.cp: 1"
        )
    if comm in ("a2a", "a2a+p2p"):
        heads = hf_config.get("num_attention_heads") or 0
        kv = hf_config.get("num_key_value_heads") or heads
        for count, what in ((heads, "attention heads"), (kv, "key/value heads")):
            per_rank = count // par.tp if count else 0
            if per_rank and per_rank % cp:
                raise ConfigError(
                    f"parallel.cp_comm_type={comm} splits each TP rank's {per_rank} {what} "
                    f"({count} / parallel.tp={par.tp}) over parallel.cp={cp}, which does not divide them; "
                    f"pick a parallel.cp that divides {per_rank}, or cp_comm_type p2p (not with sinks)"
                )


def check_replay_config(cfg, arch) -> None:
    """Refuse ``rollout.routing_replay`` where it cannot be honoured, naming the key and the fix."""
    if not cfg.rollout.routing_replay:
        return
    if not arch.is_moe:
        raise ConfigError(
            f"rollout.routing_replay=true but model.hf_dir {cfg.model.hf_dir} is a dense model (no experts); "
            "set rollout.routing_replay=false"
        )
    # Any recompute is fine: compat/router_replay.py replays each micro-batch's experts in its recompute.


def check_recompute_modules(cfg, arch) -> None:
    """Refuse selective recompute of MoE submodules the model or its experts do not have, naming the key."""
    perf = cfg.performance
    wanted = set(perf.recompute_modules) & {"moe", "moe_act"} if perf.recompute == "selective" else set()
    if wanted and not arch.is_moe:
        raise ConfigError(
            f"performance.recompute_modules={perf.recompute_modules} recomputes MoE layers but model.hf_dir "
            f"{cfg.model.hf_dir} is a dense model; use mlp (or core_attn / layernorm) instead"
        )
    if "moe_act" in wanted and not _grouped_gemm(cfg.moe.grouped_gemm, perf.layer_spec):
        raise ConfigError(
            f"performance.recompute_modules={perf.recompute_modules}: moe_act needs grouped-GEMM experts "
            f"(moe.grouped_gemm={cfg.moe.grouped_gemm}, layer_spec={perf.layer_spec}; Transformer Engine "
            "needed), which this run will not build; recompute moe instead"
        )


def _grouped_gemm(setting: bool | None, layer_spec: str) -> bool:
    """Whether the experts will be TE grouped GEMM (``models/moe.py``: None = with the TE layer spec, which
    ``auto`` picks whenever Transformer Engine imports; looked up without importing it)."""
    if setting is not None:
        return setting
    import importlib.util

    return layer_spec != "local" and importlib.util.find_spec("transformer_engine") is not None


def check_rewards(targets: list[str], rollout: Any) -> None:
    """Collective: rank 0 probes ``targets`` in the pool's kind of process; every rank raises on failure."""
    import torch.distributed as dist  # here: `srpo launch` runs this module's other checks without torch

    from srpo_megatron.rewards import RewardPool

    problem = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        workers, timeout_s = min(rollout.reward_workers, 1), rollout.reward_timeout_s
        notes: list[str] = []
        with RewardPool(workers, timeout_s, import_timeout_s=rollout.reward_import_timeout_s) as pool:
            problem = pool.check_targets(targets, notes=notes)
        for note in notes:  # a dummy call that raised: not fatal, never silent
            print(f"[srpo] note: {note}", flush=True)
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [problem]
        dist.broadcast_object_list(box, src=0)
        problem = box[0]
    if problem:
        raise ConfigError(problem)


def data_summary(train_set: Any, eval_set: Any) -> str:
    """One log line with the row counts of both splits (read, skipped as bad, dropped, truncated)."""
    parts = []
    for name, ds in (("train", train_set), ("eval", eval_set)):
        s = ds.stats
        parts.append(
            f"{name}: {len(ds)} prompts from {s.num_rows} rows, {s.num_bad} bad rows skipped, "
            f"{s.num_dropped_overlong} dropped as over-long, {s.num_truncated} truncated"
        )
    return "data: " + "; ".join(parts)
