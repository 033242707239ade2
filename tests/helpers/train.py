"""The tiny-recipe training scaffold of the integration tests: recipe overrides for a tiny run, one trainer
rank, the run's metrics and an exported checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.helpers.healthy import assert_no_recoveries
from tests.helpers.recipe import RECIPE, tiny_overrides


def train_overrides(tiny, run_dir: Path, **extra) -> list[str]:
    """``tiny_overrides`` with ``extra`` given as ``key=value`` keywords."""
    return tiny_overrides(tiny, run_dir, [f"{k}={v}" for k, v in extra.items()])


def train_rank(rank, world, overrides):
    from srpo_megatron.config import TrainConfig, load_config
    from srpo_megatron.train import train

    return train(load_config(TrainConfig, str(RECIPE), overrides))


def read_metrics(run_dir: Path, engine_faults: bool = False) -> list[dict]:
    """The run's metrics.jsonl rows; unless the run faulted an engine on purpose, none counts an engine
    restart (``tests/helpers/healthy.py``)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if not engine_faults:
        assert_no_recoveries(rows, str(run_dir / "metrics.jsonl"))
    return rows


def export_hf(ckpt: Path, out: Path) -> dict[str, torch.Tensor]:
    from srpo_megatron.conversion.checkpoint import megatron_to_hf

    megatron_to_hf(ckpt, out, progress=lambda _: None)
    return load_file(str(out / "model.safetensors"))
