"""Build the rollout engine and tokenizer a recipe asks for."""

from __future__ import annotations

from typing import Any

from srpo_megatron.rollout.base import RolloutEngine
from srpo_megatron.rollout.config import RolloutConfig


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


def build_engine(
    rollout: RolloutConfig, model_path: str, *, engine_index: int = 0, base_gpu_id: int = 0
) -> RolloutEngine:
    """Engine ``engine_index`` of the job: the CPU transformers engine (``rollout.engine=hf``) or SGLang
    (``rollout.engine=sglang``; offline on the devices from ``base_gpu_id``, or the engine_index-th
    server of ``rollout.sglang.url``)."""
    if rollout.engine == "hf":
        from srpo_megatron.rollout.hf_engine import HFEngine, HFEngineConfig

        return HFEngine.from_config(
            HFEngineConfig(model_path=model_path, max_batch_size=rollout.max_batch_size)
        )
    from srpo_megatron.rollout.sglang.engine import SGLangEngine

    cfg = rollout.sglang
    assert cfg is not None  # RolloutConfig.__post_init__ requires the section for engine=sglang
    urls = [u for u in cfg.url.split(",") if u]
    return SGLangEngine(
        cfg,
        colocated=rollout.placement == "colocated",
        base_gpu_id=base_gpu_id,
        url=urls[engine_index % len(urls)] if urls else None,
    )
