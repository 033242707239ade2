"""Policy models: HF config -> megatron-core TransformerConfig, layer specs and GPTModel."""

from srpo_megatron.models.architecture import (
    SUPPORTED_MODEL_TYPES,
    SUPPORTED_ROPE_TYPES,
    Architecture,
    UnsupportedModelError,
    padded_vocab_size,
)

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "SUPPORTED_ROPE_TYPES",
    "Architecture",
    "UnsupportedModelError",
    "padded_vocab_size",
]
