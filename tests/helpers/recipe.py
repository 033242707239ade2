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


def standin_partial_overrides(tiny) -> list[str]:
    """Separate placement against one stand-in SGLang server (``testing/sglang_standin.py``, one request in
    flight), distributed weight sync, one step off-policy with partial rollouts: the setup of the tests that
    hold a request until the sync's pause aborts it."""
    return [
        "rollout.engine=sglang",
        "rollout.placement=separate",
        "rollout.engine_nodes=1",
        f"rollout.sglang={{model_path: {tiny[1]}, weight_sync: distributed, bucket_bytes: 1048576}}",
        "rollout.sglang.concurrent_requests=1",
        "rollout.off_policy_steps=1",
        "rollout.partial=true",
    ]
