"""Read an HF ``config.json`` (Llama/SmolLM2, Qwen2/2.5, Qwen3) into a typed architecture description.

``Architecture.from_hf(config)`` accepts a path to a model folder or ``config.json``, a plain dict, or a
``transformers.PretrainedConfig``; it validates every field the policy and the converter rely on and
rejects what megatron-core's GPTModel cannot reproduce exactly (sliding-window attention, MLP biases,
non-SiLU activations, unknown RoPE scaling types, llama3 scaling with non-default band parameters),
naming the field and listing what is supported. Both the transformers 4 (``rope_theta`` +
``rope_scaling``) and transformers 5 (``rope_parameters``) spellings of RoPE are understood.

Per-family differences captured here (and nowhere else):
- llama: optional QKV bias via ``attention_bias``; ``head_dim`` may be explicit.
- qwen2: QKV bias always on (the HF module hard-codes ``bias=True`` for q/k/v), no ``head_dim`` field.
- qwen3: per-head RMSNorm on queries and keys (QK-norm), explicit ``head_dim``, bias via ``attention_bias``.
- qwen3_moe: Qwen3 attention; every layer's MLP is a softmax top-k router (``mlp.gate``) over ``num_experts``
  SwiGLU experts of width ``moe_intermediate_size``, top-k weights renormalised when ``norm_topk_prob``
  (see ``_parse_moe``).

The padded vocabulary (``padded_vocab_size``) is the megatron convention: a multiple of ``128 * tp`` so
each TP rank's embedding shard is a multiple of 128 rows. Padded rows are zero and are removed on export.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe")
MOE_MODEL_TYPES = ("qwen3_moe",)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# megatron-core's RotaryEmbedding._apply_scaling fixes these llama3 band parameters; only ``factor`` is
# configurable, so other values cannot be reproduced without patching megatron.
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
VOCAB_PAD_MULTIPLE = 128


class UnsupportedModelError(ValueError):
    """The HF config describes something this project cannot build exactly; the message names it."""


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """Smallest multiple of ``128 * tp`` that holds ``vocab_size`` rows."""
    multiple = VOCAB_PAD_MULTIPLE * tp
    return -(-vocab_size // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class Architecture:
    """The subset of an HF decoder config that determines weights and numerics."""

    model_type: str  # HF model_type: one of SUPPORTED_MODEL_TYPES
    vocab_size: int  # HF (unpadded) vocabulary rows
    hidden_size: int  # model width H
    intermediate_size: int  # SwiGLU inner width F
    num_layers: int  # transformer layers L
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (query groups); == num_heads without GQA
    head_dim: int  # per-head width (megatron kv_channels)
    norm_eps: float  # RMSNorm epsilon
    rope_theta: float  # RoPE base
    rope_type: str  # one of SUPPORTED_ROPE_TYPES
    rope_factor: float | None  # linear / llama3 scaling factor, None for "default"
    qkv_bias: bool  # q/k/v projections have biases (Qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k (Qwen3)
    tie_embeddings: bool  # lm_head shares the input embedding
    max_position_embeddings: int  # longest sequence the RoPE table is built for
    num_experts: int = 0  # routed experts per MoE layer E (0: dense model)
    moe_top_k: int = 0  # experts per token k
    moe_intermediate_size: int = 0  # SwiGLU inner width of one expert
    norm_topk_prob: bool = True  # renormalise the k selected router probabilities to sum to 1

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @classmethod
    def from_hf(cls, config: Any) -> Architecture:
        """Parse and validate an HF config (folder, config.json path, dict or PretrainedConfig)."""
        cfg = load_hf_config_dict(config)
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported; supported model types are "
                f"{list(SUPPORTED_MODEL_TYPES)} (Llama incl. SmolLM2, Qwen2/2.5, Qwen3)"
            )

        def need(key: str) -> Any:
            if cfg.get(key) is None:
                raise UnsupportedModelError(
                    f"{model_type} config has no {key!r}; a complete HF config.json is needed"
                )
            return cfg[key]

        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"hidden_act={act!r} is not supported; only 'silu' (SwiGLU) is")
        if cfg.get("mlp_bias"):
            raise UnsupportedModelError("mlp_bias=True is not supported; only bias-free SwiGLU MLPs are")
        if cfg.get("use_sliding_window"):
            raise UnsupportedModelError(
                "use_sliding_window=True is not supported: megatron's local attention has no per-layer "
                "sliding window; set use_sliding_window=false (Qwen checkpoints ship it off)"
            )
        layer_types = cfg.get("layer_types")
        if layer_types and any(t != "full_attention" for t in layer_types):
            bad = sorted({t for t in layer_types if t != "full_attention"})
            raise UnsupportedModelError(f"layer_types {bad} are not supported; only 'full_attention' is")
        if cfg.get("attention_dropout", 0.0):
            raise UnsupportedModelError(
                "attention_dropout != 0 is not supported for RL policies; set it to 0.0"
            )

        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
            )
        head_dim = cfg.get("head_dim")
        if model_type == "qwen2" or head_dim is None:
            head_dim = hidden // heads
        theta, rope_type, factor = _parse_rope(cfg)
        moe = _parse_moe(cfg) if model_type in MOE_MODEL_TYPES else {}
        return cls(
            model_type=model_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(head_dim),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_type=rope_type,
            rope_factor=factor,
            qkv_bias=True if model_type == "qwen2" else bool(cfg.get("attention_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            **moe,
        )


def pipeline_stage_layers(num_layers: int, pp: int) -> list[int]:
    """Decoder layers per pipeline stage, the one split rule of the trainer and the planner: equal when
    ``pp`` divides ``num_layers``; otherwise ceil(L/PP) in every middle stage and the rest split between the
    first and the last stage, which also hold the embedding and the output layer (Qwen3-235B's 94 layers at
    PP8: 11 / 12 × 6 / 11, the anchors' layout)."""
    if not 1 <= pp <= num_layers:
        raise ValueError(f"pipeline parallel size {pp} must be between 1 and num_hidden_layers={num_layers}")
    if num_layers % pp == 0:
        return [num_layers // pp] * pp
    if pp == 2:
        first = num_layers // 2
        return [first, num_layers - first]
    middle = -(-num_layers // pp)
    rest = num_layers - (pp - 2) * middle
    first = rest // 2
    if first < 1:
        raise ValueError(
            f"{num_layers} layers cannot be split over pipeline parallel size {pp} (the middle stages take "
            f"{middle} each, leaving {rest} for the first and last); use a pipeline size that divides them"
        )
    return [first] + [middle] * (pp - 2) + [rest - first]


def load_hf_config_dict(config: Any) -> dict[str, Any]:
    """Plain dict of an HF config given a folder, a config.json path, a dict or a PretrainedConfig."""
    if isinstance(config, dict):
        return dict(config)
    if isinstance(config, str | Path):
        path = Path(config)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no HF config at {path}: pass a model folder or its config.json")
        return json.loads(path.read_text())
    if hasattr(config, "to_dict"):
        return config.to_dict()
    raise TypeError(
        f"cannot read an HF config from {type(config).__name__}; pass a path, dict or PretrainedConfig"
    )


def _parse_rope(cfg: dict[str, Any]) -> tuple[float, str, float | None]:
    """(theta, rope_type, factor) from transformers-5 ``rope_parameters`` or transformers-4 fields."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    if "rope_theta" in params:
        merged = dict(params)
    else:
        merged = {**scaling, "rope_theta": cfg.get("rope_theta", 10000.0)}
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope scaling type {rope_type!r} is not supported; "
            f"supported rope types are {list(SUPPORTED_ROPE_TYPES)}"
        )
    factor = None
    if rope_type != "default":
        factor = float(merged["factor"])
    if rope_type == "llama3":
        for key, fixed in _LLAMA3_FIXED.items():
            if float(merged.get(key, fixed)) != fixed:
                raise UnsupportedModelError(
                    f"llama3 rope scaling with {key}={merged[key]} is not supported: megatron-core fixes it "
                    f"to {fixed}; only 'factor' may vary"
                )
    return float(merged["rope_theta"]), rope_type, factor


def _parse_moe(cfg: dict[str, Any]) -> dict[str, Any]:
    """MoE fields of a Qwen3-MoE config; every layer must be sparse (megatron builds one MoE layer spec).

    transformers 5 spells the expert count ``num_local_experts`` in ``to_dict()``; hub files say
    ``num_experts``. Both are read.
    """
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    for key, value in (("num_experts", experts), ("num_experts_per_tok", cfg.get("num_experts_per_tok"))):
        if not value:
            raise UnsupportedModelError(
                f"qwen3_moe config has no {key!r}; a complete HF config.json is needed"
            )
    if cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step", 1)) != 1:
        raise UnsupportedModelError(
            f"qwen3_moe with dense layers (mlp_only_layers={cfg.get('mlp_only_layers')}, "
            f"decoder_sparse_step={cfg.get('decoder_sparse_step')}) is not supported; every layer must be "
            "an MoE layer (mlp_only_layers=[] and decoder_sparse_step=1, as Qwen3-MoE checkpoints ship)"
        )
    if cfg.get("moe_intermediate_size") is None:
        raise UnsupportedModelError("qwen3_moe config has no 'moe_intermediate_size'")
    top_k = int(cfg["num_experts_per_tok"])
    if top_k > int(experts):
        raise UnsupportedModelError(f"num_experts_per_tok={top_k} exceeds num_experts={experts}")
    return dict(
        num_experts=int(experts),
        moe_top_k=top_k,
        moe_intermediate_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
    )
