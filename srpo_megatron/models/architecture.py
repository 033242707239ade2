"""Read an HF ``config.json`` (Llama/SmolLM2, Qwen2/2.5, Qwen3, Qwen3-MoE, DeepSeek-V3/R1, GLM-4.5/4.6 and
gpt-oss) into a typed architecture description.

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
- deepseek_v3 (DeepSeek-V3/R1): Multi-head Latent Attention (``q_lora_rank``, ``kv_lora_rank``, q/k heads of
  ``qk_nope_head_dim + qk_rope_head_dim``, v heads of ``v_head_dim``; RoPE on the ``qk_rope_head_dim`` part,
  HF's ``rope_interleave`` layout), YaRN RoPE; the first ``first_k_dense_replace`` layers dense, the rest
  MoE with ``n_shared_experts`` always-on experts and a sigmoid router with the ``e_score_correction_bias``
  (selection only), group-limited top-k (``n_group``/``topk_group``) and ``routed_scaling_factor``; MTP
  layers (``num_nextn_predict_layers``) in the hub checkpoint are not part of the policy.
- glm4_moe (GLM-4.5/4.6, GLM-4.5-Air): GQA attention with q/k/v bias, optional QK-norm (``use_qk_norm``),
  partial RoPE (``partial_rotary_factor``); the DeepSeek-V3 MoE (dense first layers, shared experts, sigmoid
  router with expert bias, groups, scaling); MTP layers as DeepSeek.
- gpt_oss (gpt-oss-20b/120b): GQA attention with biases on q/k/v/o and a learnable per-head sink,
  alternating sliding-window/full layers (``layer_types``, ``sliding_window``), YaRN RoPE; every layer
  MoE: router with a bias, top-k on the logits then a softmax over the k, experts with biases and the
  clamped SwiGLU ``(clamp(up, ±limit) + 1) * g * sigmoid(alpha * g)``, ``g = clamp(gate, max=limit)``;
  hub experts may be MXFP4 (``quantization_config.quant_method == "mxfp4"``).

The padded vocabulary (``padded_vocab_size``) is the megatron convention: a multiple of ``128 * tp`` so
each TP rank's embedding shard is a multiple of 128 rows. Padded rows are zero and are removed on export.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3", "glm4_moe", "gpt_oss")
# Hub model types that are a supported one under another name, with the HF class their config.json names:
# Kimi-K2 ships ``model_type: kimi_k2`` with ``architectures: [DeepseekV3ForCausalLM]`` (its remote code is
# DeepSeek-V3's; SGLang serves it with DeepseekV3ForCausalLM), so it parses as deepseek_v3.
MODEL_TYPE_ALIASES = {"kimi_k2": ("deepseek_v3", "DeepseekV3ForCausalLM")}
MOE_MODEL_TYPES = ("qwen3_moe", "deepseek_v3", "glm4_moe", "gpt_oss")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
YARN_MODEL_TYPES = ("deepseek_v3", "gpt_oss")  # the families whose YaRN RoPE is checked against HF
# megatron-core's RotaryEmbedding._apply_scaling fixes these llama3 band parameters; only ``factor`` is
# configurable, so other values cannot be reproduced without patching megatron.
_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
VOCAB_PAD_MULTIPLE = 128


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    """YaRN RoPE parameters as HF's ``_compute_yarn_parameters`` reads them (megatron's YarnRotaryEmbedding
    takes the same six numbers; ``truncate`` is its ``correction_range_round_to_int``)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None  # with mscale_all_dim: attention factor = m(factor, mscale) / m(factor, all)
    mscale_all_dim: float | None = None  # also scales MLA's softmax by m(factor, mscale_all_dim)**2
    truncate: bool = True  # round the correction range to integers (gpt-oss: false)

    def attention_factor(self) -> float:
        """The factor HF multiplies cos/sin by (``attention_scaling``)."""

        def m(scale: float, ms: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * ms * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return m(self.factor, self.mscale) / m(self.factor, self.mscale_all_dim)
        return m(self.factor)


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
    # DeepSeek-V3 / GLM-4.5 MoE
    first_dense_layers: int = 0  # first_k_dense_replace: layers [0, k) have a dense MLP of intermediate_size
    shared_expert_intermediate_size: int = 0  # n_shared_experts * moe_intermediate_size; 0 = no shared expert
    router_score: str = "softmax"  # "softmax" (Qwen3-MoE, gpt-oss) or "sigmoid" (DeepSeek-V3, GLM-4.5)
    router_expert_bias: bool = False  # e_score_correction_bias: added to the scores for selection only
    router_groups: int = 1  # n_group: experts in equal groups, topk_group groups chosen per token (1 = off)
    router_group_topk: int = 1  # topk_group
    routed_scaling_factor: float = 1.0  # the k routing weights are multiplied by it
    mtp_layers: int = 0  # num_nextn_predict_layers: hub layers L .. L+n-1, not part of the policy
    # Multi-head Latent Attention (DeepSeek-V3); kv_lora_rank == 0 means standard attention
    q_lora_rank: int | None = None  # None: q is one projection (no q compression)
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0  # the part of a q/k head without RoPE
    qk_rope_head_dim: int = 0  # the RoPE part (k's is one head shared by all heads)
    v_head_dim: int = 0
    rope_interleave: bool = False  # HF's rope_interleave: the RoPE dims are stored pairwise interleaved
    # RoPE extras
    yarn: YarnScaling | None = None  # set iff rope_type == "yarn"
    rotary_percent: float = 1.0  # partial_rotary_factor: RoPE on the first share of each head (GLM: 0.5)
    # gpt-oss
    linear_bias: bool = False  # biases on o_proj, the router and the experts too (q/k/v: qkv_bias)
    attention_sinks: bool = False  # a learnable per-head sink logit in every softmax
    sliding_window: int = 0  # keys per query in a sliding layer, itself included (HF's sliding_window)
    layer_types: tuple[str, ...] = ()  # per layer "full_attention" | "sliding_attention"; () = all full
    swiglu_limit: float = 0.0  # clamped SwiGLU limit (gpt-oss 7.0); 0 = plain SwiGLU
    swiglu_alpha: float = 0.0  # gate * sigmoid(alpha * gate) (gpt-oss 1.702); used iff swiglu_limit > 0
    mxfp4_experts: bool = False  # the hub checkpoint stores expert weights as MXFP4 blocks + scales

    @property
    def is_moe(self) -> bool:
        """Some layer has an MoE MLP (none when first_k_dense_replace covers every layer)."""
        return self.num_experts > 0 and self.first_dense_layers < self.num_layers

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    def is_moe_layer(self, layer: int) -> bool:
        """Whether global layer ``layer`` has an MoE MLP (the first ``first_dense_layers`` are dense)."""
        return self.is_moe and layer >= self.first_dense_layers

    def is_sliding_layer(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

    @classmethod
    def from_hf(cls, config: Any, where: str | None = None) -> Architecture:
        """Parse and validate an HF config (folder, config.json path, dict or PretrainedConfig).

        ``where`` names the config in refusals (default: the path given, else "config.json"). A
        ``quantization_config`` the converter cannot read is refused first (:func:`check_quantization`)."""
        cfg = load_hf_config_dict(config)
        if where is None:
            where = str(config) if isinstance(config, str | Path) else "config.json"
        model_type = cfg.get("model_type")
        if model_type in MODEL_TYPE_ALIASES:
            model_type, hf_class = MODEL_TYPE_ALIASES[model_type]
            if hf_class not in (cfg.get("architectures") or [hf_class]):
                raise UnsupportedModelError(
                    f"{where}: model_type {cfg['model_type']!r} with architectures "
                    f"{cfg.get('architectures')} is not supported; it is read as {model_type} only with "
                    f"architectures [{hf_class!r}]"
                )
            cfg["model_type"] = model_type
        check_quantization(cfg, where)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported; supported model types are "
                f"{list(SUPPORTED_MODEL_TYPES)} (Llama incl. SmolLM2, Qwen2/2.5, Qwen3, Qwen3-MoE, "
                "DeepSeek-V3, GLM-4.5, gpt-oss)"
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
        if model_type != "gpt_oss":
            if cfg.get("use_sliding_window"):
                raise UnsupportedModelError(
                    "use_sliding_window=True is not supported: megatron's local attention has no per-layer "
                    "sliding window; set use_sliding_window=false (Qwen checkpoints ship it off)"
                )
            layer_types = cfg.get("layer_types")
            if layer_types and any(t != "full_attention" for t in layer_types):
                bad = sorted({t for t in layer_types if t != "full_attention"})
                raise UnsupportedModelError(
                    f"layer_types {bad} are not supported for {model_type}; only 'full_attention' is"
                )
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
        theta, rope_type, factor, yarn = _parse_rope(cfg, model_type)
        fields: dict[str, Any] = dict(
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
            yarn=yarn,
        )
        if model_type == "qwen3_moe":
            fields.update(_parse_moe(cfg))
        elif model_type == "deepseek_v3":
            fields.update(_parse_deepseek_moe(cfg, model_type, fields["num_layers"]))
            fields.update(_parse_mla(cfg))
        elif model_type == "glm4_moe":
            fields.update(_parse_deepseek_moe(cfg, model_type, fields["num_layers"]))
            fields.update(_parse_glm_attention(cfg))
        elif model_type == "gpt_oss":
            fields.update(_parse_gpt_oss(cfg, fields["num_layers"]))
        return cls(**fields)


# What the converter reads besides bf16/fp16/fp32 folders (conversion/fp8_layout.py, conversion/mxfp4.py).
READABLE_QUANTIZATION = (
    "blockwise FP8 (quant_method 'fp8', fmt 'e4m3', a 2-D weight_block_size such as [128, 128], dynamic "
    "activations: DeepSeek-V3, Kimi-K2, Qwen3-FP8) and gpt-oss's MXFP4 experts (quant_method 'mxfp4')"
)


def check_quantization(cfg: dict[str, Any], where: str) -> None:
    """Refuse, in one line naming ``where``, the method and the fix, a ``quantization_config`` whose weights
    the converter cannot dequantize exactly (:data:`READABLE_QUANTIZATION`). The same blockwise-FP8 rule as
    ``conversion/fp8_layout.py``'s ``Fp8Layout.from_quantization_config`` (which this layer cannot import;
    ``tests/unit/test_fp8_import_rules.py`` checks that both agree), plus what that one leaves to the
    checkpoint's tensors: static activation scales and scale formats other than fp32 (``ue8m0``'s
    power-of-two scales are fp32 values too)."""
    qc = cfg.get("quantization_config")
    if qc is None:
        return
    fix = "convert the model's bf16 release instead, or dequantize the folder to bf16 first"
    if not isinstance(qc, dict):
        raise UnsupportedModelError(f"{where}: quantization_config is {qc!r}, not an object; {fix}")
    method, model_type = qc.get("quant_method"), cfg.get("model_type")
    if method == "mxfp4" and model_type == "gpt_oss":
        return
    if method != "fp8" or model_type == "gpt_oss":
        raise UnsupportedModelError(
            f"{where}: quantization_config.quant_method={method!r} (model_type {model_type!r}) cannot be "
            f"read by the converter, which reads bf16/fp16/fp32 folders, {READABLE_QUANTIZATION}; {fix}"
        )
    block, fmt = qc.get("weight_block_size"), qc.get("fmt", "e4m3")
    blockwise = isinstance(block, list) and len(block) == 2
    blockwise = blockwise and all(isinstance(b, int) and b > 0 for b in block)
    problem = None
    if fmt != "e4m3":
        problem = f"fmt {fmt!r} (only e4m3 is read)"
    elif not blockwise:
        problem = f"weight_block_size {block!r} (per-tensor or per-channel FP8; only 2-D blocks are read)"
    elif qc.get("activation_scheme", "dynamic") != "dynamic":
        problem = f"activation_scheme {qc.get('activation_scheme')!r} (static input scales are not read)"
    elif qc.get("scale_fmt") not in (None, "ue8m0"):
        problem = f"scale_fmt {qc.get('scale_fmt')!r}"
    if problem:
        raise UnsupportedModelError(
            f"{where}: quantization_config quant_method 'fp8' with {problem} cannot be read by the "
            f"converter, which reads {READABLE_QUANTIZATION}; {fix}"
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


def _parse_rope(cfg: dict[str, Any], model_type: str) -> tuple[float, str, float | None, YarnScaling | None]:
    """(theta, rope_type, factor, yarn) from transformers-5 ``rope_parameters`` or transformers-4 fields."""
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
    yarn = None
    if rope_type == "yarn" and model_type not in YARN_MODEL_TYPES:
        raise UnsupportedModelError(
            f"rope scaling type 'yarn' is not supported for {model_type}: the policy's YaRN is verified "
            f"against HF only for {list(YARN_MODEL_TYPES)}; supported rope types for {model_type} are "
            "['default', 'linear', 'llama3']"
        )
    if rope_type == "yarn":
        if merged.get("original_max_position_embeddings") is None:
            raise UnsupportedModelError(
                "yarn rope scaling needs 'original_max_position_embeddings' (the pre-training context)"
            )
        yarn = YarnScaling(
            factor=float(merged["factor"]),
            original_max_position_embeddings=int(merged["original_max_position_embeddings"]),
            beta_fast=float(merged.get("beta_fast") or 32.0),
            beta_slow=float(merged.get("beta_slow") or 1.0),
            mscale=None if merged.get("mscale") is None else float(merged["mscale"]),
            mscale_all_dim=None if merged.get("mscale_all_dim") is None else float(merged["mscale_all_dim"]),
            truncate=bool(merged.get("truncate", True)),
        )
        given = merged.get("attention_factor")
        if given is not None and abs(float(given) - yarn.attention_factor()) > 1e-12:
            raise UnsupportedModelError(
                f"yarn attention_factor={given} differs from the one derived from factor/mscale "
                f"({yarn.attention_factor()}); megatron derives it, so an explicit value cannot be reproduced"
            )
    return float(merged["rope_theta"]), rope_type, factor, yarn


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


def _parse_deepseek_moe(cfg: dict[str, Any], model_type: str, num_layers: int) -> dict[str, Any]:
    """The DeepSeek-V3 MoE (also GLM-4.5's): dense first layers, shared experts, a sigmoid router whose
    ``e_score_correction_bias`` shifts only the selection, group-limited top-k, scaled weights."""

    def need(key: str) -> Any:
        if cfg.get(key) is None:
            raise UnsupportedModelError(
                f"{model_type} config has no {key!r}; a complete HF config.json is needed"
            )
        return cfg[key]

    experts, top_k = int(need("n_routed_experts")), int(need("num_experts_per_tok"))
    if top_k > experts:
        raise UnsupportedModelError(f"num_experts_per_tok={top_k} exceeds n_routed_experts={experts}")
    dense = int(cfg.get("first_k_dense_replace") or 0)
    if not 0 <= dense <= num_layers:
        raise UnsupportedModelError(
            f"first_k_dense_replace={dense} must be in [0, num_hidden_layers={num_layers}]"
        )
    if int(cfg.get("moe_layer_freq", 1)) != 1:
        raise UnsupportedModelError(
            f"moe_layer_freq={cfg.get('moe_layer_freq')} is not supported; every layer after "
            "first_k_dense_replace must be MoE (moe_layer_freq=1, as DeepSeek-V3 and GLM-4.5 ship)"
        )
    scoring = cfg.get("scoring_func", "sigmoid")
    if scoring != "sigmoid":
        raise UnsupportedModelError(
            f"{model_type} scoring_func={scoring!r} is not supported; the {model_type} router is sigmoid"
        )
    groups, group_topk = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
    if experts % groups:
        raise UnsupportedModelError(f"n_group={groups} must divide n_routed_experts={experts}")
    if not 1 <= group_topk <= groups:
        raise UnsupportedModelError(f"topk_group={group_topk} must be in [1, n_group={groups}]")
    if groups > 1 and top_k != 2 * group_topk:
        raise UnsupportedModelError(
            f"n_group={groups} with num_experts_per_tok={top_k} and topk_group={group_topk} cannot be "
            "reproduced: "
            "HF scores a group by its top-2 experts, megatron by its top num_experts_per_tok/topk_group; "
            "they agree only when num_experts_per_tok == 2 * topk_group (DeepSeek-V3: 8 = 2 * 4)"
        )
    shared = int(cfg.get("n_shared_experts") or 0)
    moe_f = int(need("moe_intermediate_size"))
    return dict(
        num_experts=experts,
        moe_top_k=top_k,
        moe_intermediate_size=moe_f,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        first_dense_layers=dense,
        shared_expert_intermediate_size=shared * moe_f,
        router_score="sigmoid",
        router_expert_bias=True,
        router_groups=groups if group_topk < groups else 1,
        router_group_topk=group_topk if group_topk < groups else 1,
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0),
    )


def _parse_mla(cfg: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V3's Multi-head Latent Attention dimensions."""
    for key in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if not cfg.get(key):
            raise UnsupportedModelError(
                f"deepseek_v3 config has no {key!r}; a complete HF config.json is needed"
            )
    if cfg.get("attention_bias"):
        raise UnsupportedModelError(
            "deepseek_v3 with attention_bias=True is not supported (the checkpoints have none)"
        )
    nope, rope = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"])
    heads = int(cfg["num_attention_heads"])
    return dict(
        q_lora_rank=None if cfg.get("q_lora_rank") is None else int(cfg["q_lora_rank"]),
        kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=int(cfg["v_head_dim"]),
        head_dim=nope + rope,  # the q/k head width
        num_kv_heads=heads,  # MLA: every head has its own k and v (decompressed from the latent)
        rope_interleave=bool(cfg.get("rope_interleave", True)),
        qkv_bias=False,
    )


def _parse_glm_attention(cfg: dict[str, Any]) -> dict[str, Any]:
    """GLM-4.5's attention: q/k/v bias (``attention_bias``), optional QK-norm, partial RoPE."""
    params = cfg.get("rope_parameters") or {}
    partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5)))
    if not 0 < partial <= 1:
        raise UnsupportedModelError(f"partial_rotary_factor={partial} must be in (0, 1]")
    return dict(qk_norm=bool(cfg.get("use_qk_norm", False)), rotary_percent=partial)


def _parse_gpt_oss(cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """gpt-oss: sinks, alternating sliding windows, biases everywhere, the clamped SwiGLU, MXFP4 experts."""
    experts = cfg.get("num_local_experts", cfg.get("num_experts"))
    top_k = cfg.get("num_experts_per_tok", cfg.get("experts_per_token"))
    if not experts or not top_k:
        raise UnsupportedModelError(
            "gpt_oss config has no 'num_local_experts'/'num_experts_per_tok'; a complete HF config.json "
            "is needed"
        )
    layer_types = tuple(cfg.get("layer_types") or ())
    if not layer_types:  # transformers' default: even layers sliding, odd layers full
        layer_types = tuple(
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)
        )
    if len(layer_types) != num_layers or set(layer_types) - {"sliding_attention", "full_attention"}:
        raise UnsupportedModelError(
            f"gpt_oss layer_types must list 'sliding_attention'/'full_attention' for each of the "
            f"{num_layers} "
            f"layers; got {list(layer_types)}"
        )
    window = int(cfg.get("sliding_window") or 0)
    if "sliding_attention" in layer_types and window < 1:
        raise UnsupportedModelError("gpt_oss has sliding layers but no 'sliding_window' (keys per query)")
    method = (cfg.get("quantization_config") or {}).get("quant_method")  # checked by check_quantization
    bias = bool(cfg.get("attention_bias", True))
    return dict(
        num_experts=int(experts),
        moe_top_k=int(top_k),
        moe_intermediate_size=int(cfg["intermediate_size"]),
        norm_topk_prob=True,  # softmax over the k selected logits
        linear_bias=bias,
        qkv_bias=bias,
        attention_sinks=True,
        sliding_window=window,
        layer_types=layer_types,
        swiglu_limit=float(cfg.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
        mxfp4_experts=method == "mxfp4",
    )
