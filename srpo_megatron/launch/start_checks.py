"""The recipe's start-up checks that need only the model's HF config, run by ``srpo launch`` before it
submits, so a refusal the job would print after its allocation (in one rank's log) is one line here.

They are the trainer's own functions, not copies: the top-K and sequence budget against the model
(``trainer.run.preflight.check_model_limits``), the parallel layout against the job's process count, heads,
experts (``parallel.ep``) and layers (``trainer.run.preflight.check_layout``), CP with attention sinks
(``check_attention_cp``), rollout routing replay against the model
(``trainer.run.preflight.check_replay_config``), and the served folder's quantization against
``rollout.precision`` (``rollout.served_precision.check_served_precision``). The HF config is read as
``srpo plan`` reads it (``model.hf_dir``'s ``config.json``, else the packaged config of that name); when
neither is readable on this machine the checks are skipped with a note (the job's doctor step reads it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from srpo_megatron.config import ConfigError


def check_before_submit(cfg: Any, world_size: int, log: Callable[[str], None] = print) -> None:
    """Refuse ``cfg`` (a loaded recipe) on ``world_size`` training processes as ``srpo train`` would at
    start-up, before anything is submitted (ConfigError: one line naming the key and the fix)."""
    from srpo_megatron.models.architecture import Architecture, UnsupportedModelError
    from srpo_megatron.planner.command import resolve_hf_config
    from srpo_megatron.rollout.served_precision import check_served_precision

    check_served_precision(cfg)  # reads the served folder itself; skipped where it is not readable here
    try:
        hf_config, _ = resolve_hf_config(cfg.model.hf_dir)
    except ConfigError:
        log(f"# start-up checks skipped: no config.json readable here for {cfg.model.hf_dir}")
        return
    from srpo_megatron.trainer.run.preflight import (
        check_attention_cp,
        check_layout,
        check_model_limits,
        check_recompute_modules,
        check_replay_config,
    )

    check_model_limits(cfg, hf_config)
    check_layout(cfg, world_size, hf_config)
    check_attention_cp(cfg, hf_config)  # gpt-oss sinks under CP: the a2a exchange only
    try:
        arch = Architecture.from_hf(hf_config)
    except UnsupportedModelError as e:
        raise ConfigError(f"model.hf_dir {cfg.model.hf_dir}: {e}") from None
    check_replay_config(cfg, arch)
    check_recompute_modules(cfg, arch)
