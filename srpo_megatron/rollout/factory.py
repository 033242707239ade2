"""Build the rollout engine and tokenizer a recipe asks for."""

from __future__ import annotations

from typing import Any

from srpo_megatron.rollout.base import RolloutEngine


def load_tokenizer(hf_dir: str) -> Any:
    """The policy's tokenizer (with its chat template) from the HF folder."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(hf_dir)
    except (OSError, ValueError) as e:
        raise FileNotFoundError(
            f"cannot load a tokenizer from model.hf_dir={hf_dir!r}: {e}. The folder needs tokenizer files "
            "(tokenizer.json / tokenizer_config.json with a chat template)"
        ) from e


def build_engine(rollout: Any, model: Any) -> RolloutEngine:
    """The CPU transformers engine (``rollout.engine=hf``) or SGLang (``rollout.engine=sglang``)."""
    if rollout.engine == "hf":
        from srpo_megatron.rollout.hf_engine import HFEngine, HFEngineConfig

        return HFEngine.from_config(
            HFEngineConfig(model_path=model.hf_dir, max_batch_size=rollout.max_batch_size)
        )
    from srpo_megatron.rollout.sglang.engine import SGLangEngine

    return SGLangEngine(rollout.sglang)
