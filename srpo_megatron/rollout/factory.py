"""Build the rollout engine and tokenizer a recipe asks for."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from srpo_megatron.config import RolloutConfig
from srpo_megatron.conversion.output_guard import check_conversion_sizes
from srpo_megatron.rollout.base import RolloutEngine


def load_tokenizer(hf_dir: str) -> Any:
    """The policy's tokenizer (with its chat template) from the HF folder."""
    from transformers import AutoTokenizer

    check_conversion_sizes(Path(hf_dir))  # a converter output's truncated file: one line naming it
    try:
        return AutoTokenizer.from_pretrained(hf_dir)
    except (OSError, ValueError) as e:
        raise FileNotFoundError(
            f"cannot load a tokenizer from model.hf_dir={hf_dir!r}: {e}. The folder needs tokenizer files "
            "(tokenizer.json / tokenizer_config.json with a chat template)"
        ) from e


def build_engine(
    rollout: RolloutConfig,
    model_path: str,
    *,
    engine_index: int = 0,
    base_gpu_id: int = 0,
    urls: list[str] | None = None,
) -> RolloutEngine:
    """Engine ``engine_index`` of the job: the CPU transformers engine (``rollout.engine=hf``) or SGLang
    (``rollout.engine=sglang``; offline on the devices from ``base_gpu_id``, or the engine_index-th
    server of ``urls`` / ``rollout.sglang.url``). Separate placement always talks HTTP to its server
    and waits for it to come up (the job starts the servers as the trainer starts). How weights reach
    the engine is not decided here: ``weights.weight_sync.build_weight_sync`` picks the strategy."""
    check_conversion_sizes(Path(model_path))  # a converter output's truncated shard: one line
    if rollout.engine == "hf":
        from srpo_megatron.rollout.hf_engine import HFEngine, HFEngineConfig

        return HFEngine.from_config(
            HFEngineConfig(
                model_path=model_path,
                max_batch_size=rollout.max_batch_size,
                precision=rollout.precision,
                # the parity audits' switch: the served precision's own gap, next to the trainer's
                precision_audit=rollout.parity_top_k > 0,
                true_on_policy_mode=rollout.true_on_policy_mode,
            )
        )
    from srpo_megatron.rollout.sglang.engine import SGLangEngine

    cfg = rollout.sglang
    assert cfg is not None  # RolloutConfig.__post_init__ requires the section for engine=sglang
    urls = urls or [u for u in cfg.url.split(",") if u]
    url = urls[engine_index % len(urls)] if urls else None
    if rollout.placement == "separate":
        assert url is not None  # rollout.placement.engine_urls refuses an empty list
        cfg = dataclasses.replace(cfg, mode="http", url=url)
        wait_until_healthy(url, cfg.startup_timeout_s)
        return SGLangEngine(cfg, colocated=False, url=url)
    return SGLangEngine(
        cfg, colocated=True, base_gpu_id=base_gpu_id, url=url, routed_experts=rollout.routing_replay
    )


def wait_until_healthy(url: str, timeout_s: float, poll_s: float = 5.0) -> None:
    """Block until the SGLang server at ``url`` answers ``/health`` (model loaded), or raise."""
    from srpo_megatron.rollout.base import EngineError
    from srpo_megatron.rollout.sglang.transports import HttpTransport

    transport = HttpTransport(url, timeout_s=min(poll_s * 6, 60.0))
    deadline = time.monotonic() + timeout_s
    while not transport.health():
        if time.monotonic() > deadline:
            raise EngineError(
                f"SGLang server {url} did not become healthy within {timeout_s:.0f}s "
                "(rollout.sglang.startup_timeout_s); see the job's engines_*.out log"
            )
        time.sleep(poll_s)
