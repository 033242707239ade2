"""The tiny recipe (``examples/tiny_cpu_test.yaml``) pointed at a tiny run: the overrides every trainer test
gives it, and the typed ``TrainConfig`` they load. ``tiny`` is ``srpo_megatron.testing.tiny.write_tiny_run``'s
``(root, hf_dir, data)``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "examples" / "tiny_cpu_test.yaml"


def tiny_overrides(tiny, run_dir, extra: Sequence[str] = ()) -> list[str]:
    """The recipe overrides of a tiny run: its model folder, its prompts, ``run_dir``, then ``extra``."""
    _, hf, data = tiny
    return [f"model.hf_dir={hf}", f"data.train_files=[{data}]", f"run.dir={run_dir}", *extra]


def tiny_config(tiny, run_dir, extra: Sequence[str] = ()):
    """The tiny recipe loaded as the trainer loads it, with ``tiny_overrides``."""
    from srpo_megatron.config import TrainConfig, load_config

    return load_config(TrainConfig, str(RECIPE), tiny_overrides(tiny, run_dir, extra))
