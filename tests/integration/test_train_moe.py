"""End-to-end ``srpo train`` of a tiny random Qwen3-MoE (4 experts, top-2, real Qwen vocabulary) with expert
parallelism, on gloo ranks with the CPU rollout engine.

- 3 SRPO steps at EP2 (world 2) and at TP2×EP2 (world 4, sequence parallel) complete, train, and log the
  MoE metrics every step; their first-step loss equals EP1's (≤ 1e-5).
- A checkpoint saved at EP2 loads at EP1 with identical logits: ``tests/dist/test_moe_conversion.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from srpo_megatron.testing.distributed import run_distributed

pytestmark = pytest.mark.moe

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "examples" / "tiny_cpu_test.yaml"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from srpo_megatron.testing.tiny import write_tiny_run

    return write_tiny_run(tmp_path_factory.mktemp("tiny_moe"), num_prompts=16, moe=True)


def _overrides(tiny, run_dir: Path, **extra) -> list[str]:
    _, hf, data = tiny
    out = [f"model.hf_dir={hf}", f"data.train_files=[{data}]", f"run.dir={run_dir}"]
    return out + [f"{k}={v}" for k, v in extra.items()]


def _train_rank(rank, world, overrides):
    from srpo_megatron.configs import load_config
    from srpo_megatron.train import train
    from srpo_megatron.trainer.config import TrainConfig

    return train(load_config(TrainConfig, str(RECIPE), overrides))


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _run(tiny, name: str, world: int, **extra) -> Path:
    run_dir = tiny[0] / name
    run_distributed(_train_rank, world, _overrides(tiny, run_dir, **extra), timeout=900)
    return run_dir


@pytest.fixture(scope="module")
def ep1_run(tiny):
    return _run(tiny, "ep1", 1, **{"train.steps": 1})


@pytest.fixture(scope="module")
def ep2_run(tiny):
    return _run(tiny, "ep2", 2, **{"parallel.ep": 2})


@pytest.fixture(scope="module")
def tp2_ep2_run(tiny):
    return _run(tiny, "tp2ep2", 4, **{"parallel.ep": 2, "parallel.tp": 2})


def _check_three_steps(tiny, run_dir: Path, tmp_path: Path) -> list[dict]:
    from srpo_megatron.conversion.checkpoint import megatron_to_hf

    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["train/skipped_steps"] == 0.0
        assert r["logprob/gap_max"] < 1e-4, "engine and trainer must hold the same weights"
    initial = load_file(str(tiny[1] / "model.safetensors"))
    megatron_to_hf(run_dir / "checkpoints" / "step_000003", tmp_path / "final", progress=lambda _: None)
    final = load_file(str(tmp_path / "final" / "model.safetensors"))
    assert initial.keys() == final.keys()
    experts = [k for k in initial if ".mlp.experts." in k]
    assert experts, "the export must carry per-expert tensors"
    moved = max((final[k] - initial[k]).abs().max().item() for k in experts)
    assert moved > 1e-5, "three optimizer steps must change the experts"
    return rows


def test_three_srpo_steps_at_ep2(tiny, ep1_run, ep2_run, tmp_path):
    rows = _check_three_steps(tiny, ep2_run, tmp_path)
    (ep1,) = _metrics(ep1_run)
    assert rows[0]["reward/mean"] == ep1["reward/mean"], "same seed, same weights: same rollouts"
    assert rows[0]["loss/total"] == pytest.approx(ep1["loss/total"], abs=1e-5)
    assert rows[0]["grad_norm"] == pytest.approx(ep1["grad_norm"], rel=1e-4)


def test_three_srpo_steps_at_tp2_ep2(tiny, ep1_run, tp2_ep2_run, tmp_path):
    rows = _check_three_steps(tiny, tp2_ep2_run, tmp_path)
    (ep1,) = _metrics(ep1_run)
    assert rows[0]["reward/mean"] == ep1["reward/mean"]
    assert rows[0]["loss/total"] == pytest.approx(ep1["loss/total"], abs=1e-5)
    assert rows[0]["grad_norm"] == pytest.approx(ep1["grad_norm"], rel=1e-4)
