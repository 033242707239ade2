"""The recipe's ``model`` section: the policy's HF folder and optional converted checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from srpo_megatron.config.loading import ConfigError


@dataclass
class ModelConfig:
    """The policy: an HF folder (config, tokenizer, weights) and optionally a converted checkpoint."""

    hf_dir: str = ""  # HF model folder (config.json, tokenizer, safetensors); the rollout engine loads it
    megatron_checkpoint: str | None = None  # tools/convert_hf_to_megatron.py output; None = read hf_dir
    params_dtype: Literal["auto", "fp32", "bf16"] = "auto"  # auto: bf16 (fp32 main params) on CUDA, else fp32
    max_sequence_length: int = 4096  # longest prompt + response the policy will see (RoPE table size)

    def __post_init__(self) -> None:
        if self.max_sequence_length < 1:
            raise ConfigError(f"model.max_sequence_length={self.max_sequence_length} must be >= 1 (tokens)")
        if not self.hf_dir:
            raise ConfigError(
                "model.hf_dir is empty: point it at an HF model folder (config.json + tokenizer + "
                "safetensors), e.g. the output of tools/prepare_smollm2.py"
            )
