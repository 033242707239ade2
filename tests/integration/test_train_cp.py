"""End-to-end `srpo train` with context parallelism: 2 SRPO steps at CP2 (world 2, gloo), packing on.

Every method §6 metric is logged each step; the teacher's count of scored samples equals the routing's SDPO
share (the CP ranks' counts are counted once); the engine serves exactly the trainer's weights after each
sync (log-prob gap ≈ 0: the CP replicas export one copy); the step-2 checkpoint converts to HF and the
weights moved. A recipe with CP but no packing is refused before anything loads, naming file and keys.
"""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from srpo_megatron.testing.distributed import run_distributed
from srpo_megatron.trainer.step_types import METHOD_METRICS
from tests.helpers.train import export_hf, read_metrics, train_overrides, train_rank

pytestmark = pytest.mark.packing


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from srpo_megatron.testing.tiny import write_tiny_run

    return write_tiny_run(tmp_path_factory.mktemp("tiny_cp"), num_prompts=8)


def test_two_srpo_steps_at_cp2(tiny, tmp_path):
    run_dir = tmp_path / "cp2"
    extra = {"parallel.cp": 2, "train.max_tokens_per_micro_batch": 256, "train.steps": 2}
    run_distributed(train_rank, 2, train_overrides(tiny, run_dir, **extra), timeout=900)
    rows = read_metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    group = 4 * 4  # prompts_per_step × group_size of the recipe
    for r in rows:
        missing = [k for k in METHOD_METRICS if r.get(k) is None]
        assert not missing, f"step {r['step']} lacks method §6 metrics {missing}"
        sdpo_samples = round(r["route/sdpo_frac"] * group)
        assert r["samples/teacher_forward"] == sdpo_samples, "teacher samples counted once per CP group"
        assert r["logprob/gap_max"] < 1e-4, "engine and trainer must hold the same weights"
        assert r["train/skipped_steps"] == 0.0
    initial = load_file(str(tiny[1] / "model.safetensors"))
    final = export_hf(run_dir / "checkpoints" / "step_000002", tmp_path / "final")
    assert initial.keys() == final.keys()
    moved = max((final[k] - initial[k]).abs().max().item() for k in initial)
    assert moved > 1e-4, "two optimizer steps must change the weights"
