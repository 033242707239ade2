"""What every weight-sync strategy shares: the manifest the SGLang servers load and the collective that
agrees on which engines failed an update. A leaf of ``weights/``: the strategies import it, the factory
(``weight_sync.py``) imports the strategies."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from srpo_megatron.conversion.manifest import hf_manifest
from srpo_megatron.rollout.placement import EngineLayout
from srpo_megatron.rollout.served_precision import served_folder, served_fp8_layout, with_fp8_scales


def served_manifest(cfg: Any) -> tuple[dict[str, tuple[int, ...]], frozenset[str]]:
    """The checkpoint names and shapes the SGLang servers load (the conversion table's, from the served
    model's folder), and the tied aliases a stream may carry beyond them. A blockwise FP8 folder adds each
    FP8 weight's ``weight_scale_inv`` (``rollout.served_precision.with_fp8_scales``)."""
    folder = served_folder(cfg)
    manifest = with_fp8_scales(hf_manifest(folder), served_fp8_layout(folder))
    return manifest, frozenset(a for a in ("lm_head.weight",) if a not in manifest)


def agree_failures(layout: EngineLayout, group: Any, engine: int, error: str) -> dict[int, str]:
    """Collective over ``group`` (gloo): every rank's ``error`` for its ``engine`` ("" = none), merged to
    ``{engine: error}`` on every rank."""
    everyone: list[Any] = [(engine, error)]
    if layout.world_size > 1:
        everyone = [None] * layout.world_size
        dist.all_gather_object(everyone, (engine, error), group=group)
    return {k: e for k, e in everyone if e}
