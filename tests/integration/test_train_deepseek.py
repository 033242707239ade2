"""End-to-end ``srpo train`` of the full tiny DeepSeek-V3 (``write_tiny_deepseek``: MLA with q compression and
YaRN, a dense first layer, 8 grouped experts top-2 + a shared expert, the sigmoid router with a nonzero
expert bias; real Qwen vocabulary) on gloo ranks with the CPU rollout engine.

- 3 SRPO steps at EP2 complete with EP1's first-step loss (<= 1e-5) and grad norm; the engine's and the
  trainer's log-probs agree (same weights, fp32); the experts move and the frozen expert bias does not.
- One packed step (THD) at CP2 equals the unpacked EP1 step (MLA's RoPE per CP rank, SDPA core attention
  over the gathered keys).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from srpo_megatron.testing.distributed import run_distributed

pytestmark = [pytest.mark.moe, pytest.mark.timeout(2400)]

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "examples" / "tiny_cpu_test.yaml"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from srpo_megatron.testing.tiny import write_tiny_deepseek

    root = tmp_path_factory.mktemp("tiny_deepseek")
    hf = write_tiny_deepseek(root / "deepseek_v3")
    data = root / "train.jsonl"
    rows = [
        {"prompt": f"Tell me a fact about the number {i}.", "system": None, "answer": "-", "kind": "coin"}
        for i in range(16)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root, hf, data


def _train_rank(rank, world, overrides):
    from srpo_megatron.config import TrainConfig, load_config
    from srpo_megatron.train import train

    return train(load_config(TrainConfig, str(RECIPE), overrides))


def _run(tiny, name: str, world: int, **extra) -> list[dict]:
    root, hf, data = tiny
    run_dir = root / name
    overrides = [f"model.hf_dir={hf}", f"data.train_files=[{data}]", f"run.dir={run_dir}"]
    overrides += [f"{k}={v}" for k, v in extra.items()]
    run_distributed(_train_rank, world, overrides, timeout=1800)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def ep1(tiny):
    (row,) = _run(tiny, "ep1", 1, **{"train.steps": 1})
    return row


def _same_first_step(row: dict, ep1: dict) -> None:
    assert row["reward/mean"] == ep1["reward/mean"], "same seed, same weights: same rollouts"
    assert row["loss/total"] == pytest.approx(ep1["loss/total"], abs=1e-5)
    assert row["grad_norm"] == pytest.approx(ep1["grad_norm"], rel=1e-4)


def test_three_srpo_steps_at_ep2(tiny, ep1, tmp_path):
    from srpo_megatron.conversion.checkpoint import megatron_to_hf

    rows = _run(tiny, "ep2", 2, **{"parallel.ep": 2})
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["train/skipped_steps"] == 0.0
        assert r["logprob/gap_max"] < 1e-4, "engine and trainer must hold the same weights"
        assert 1.0 <= r["moe/expert_load_max_over_mean"] <= 8 / 2
    _same_first_step(rows[0], ep1)
    initial = load_file(str(tiny[1] / "model.safetensors"))
    run_dir = tiny[0] / "ep2"
    megatron_to_hf(run_dir / "checkpoints" / "step_000003", tmp_path / "final", progress=lambda _: None)
    final = load_file(str(tmp_path / "final" / "model.safetensors"))
    assert initial.keys() == final.keys()
    experts = [k for k in initial if ".mlp.experts." in k]
    assert max((final[k] - initial[k]).abs().max().item() for k in experts) > 1e-5
    mla = [k for k in initial if "kv_b_proj" in k or "q_b_proj" in k]
    assert max((final[k] - initial[k]).abs().max().item() for k in mla) > 1e-5
    biases = [k for k in initial if k.endswith("e_score_correction_bias")]
    assert biases and all(torch.equal(final[k], initial[k]) for k in biases), "the expert bias is frozen"


def test_packed_step_at_cp2_equals_ep1(tiny, ep1):
    (row,) = _run(
        tiny, "cp2", 2, **{"train.steps": 1, "train.max_tokens_per_micro_batch": 64, "parallel.cp": 2}
    )
    assert row["logprob/gap_max"] < 1e-4
    _same_first_step(row, ep1)
