"""What the live-engine checks share: a small random bf16 model folder, its weights, a changed copy.

The folder is a 2-layer Qwen3 with a 1024-token vocabulary and no tokenizer (SGLang runs with
``skip_tokenizer_init``: token ids in, token ids out), written with ``save_pretrained`` in bf16, the dtype
the engines serve in production. It names no EOS token, so a request runs to its ``max_new_tokens`` (the
pause check needs one still running after a second). ``scaled`` multiplies every tensor by a factor: a
weight update whose effect on sampled tokens shows.
"""

from __future__ import annotations

from pathlib import Path

VOCAB = 1024
CONTEXT = 16384


def write_random_model(out: Path, seed: int = 0) -> Path:
    """A random bf16 Qwen3 HF folder (config.json + model.safetensors) at ``out``; reused when present."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    if (out / "config.json").is_file():
        return out
    config = Qwen3Config(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=CONTEXT,
        tie_word_embeddings=False, eos_token_id=None, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(out)
    return out


def load_weights(folder: Path, device: str = "cuda") -> dict:
    """HF name -> tensor of the folder's safetensors files, on ``device``."""
    from safetensors.torch import load_file

    weights = {}
    for f in sorted(folder.glob("*.safetensors")):
        weights.update(load_file(str(f), device=device))
    return weights


def scaled(weights: dict, factor: float) -> dict:
    return {name: (t.float() * factor).to(t.dtype) for name, t in weights.items()}
