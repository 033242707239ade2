"""End-to-end ``srpo train`` of the full tiny DeepSeek-V3 (``write_tiny_deepseek``: MLA with q compression and
YaRN, a dense first layer, 8 grouped experts top-2 + a shared expert, the sigmoid router with a nonzero
expert bias; real Qwen vocabulary) on gloo ranks with the CPU rollout engine.

- 3 SRPO steps at EP2 complete with EP1's first-step loss (<= 1e-5) and grad norm; the engine's and the
  trainer's log-probs agree (same weights, fp32); the experts move and the frozen expert bias does not.
- One packed step (THD) at CP2 equals the unpacked EP1 step (MLA's RoPE per CP rank, SDPA core attention
  over the gathered keys).
- Routing replay against an engine that routes differently (its routers' weights and expert biases are
  perturbed after every weight sync, a stand-in for a real SGLang engine's bf16 / kernel differences): 3
  steps at EP2 use the engine's experts on every response token of every MoE layer (mismatch share 0) while
  the trainer's own group-limited sigmoid/bias router would choose otherwise, with EP1's first-step loss
  under the same replay; without replay the mismatch shows.
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


ROUTER_NOISE = 0.3  # std of the noise added to the engine's router weights (drawn with std 0.5)
BIAS_NOISE = 0.1  # std of the noise added to the engine's expert biases (drawn with std 0.3)


def _train_rank(rank, world, overrides, perturbed=False):
    from srpo_megatron.config import TrainConfig, load_config
    from srpo_megatron.rollout.hf_engine import HFEngine
    from srpo_megatron.train import train

    if perturbed:
        install = HFEngine.update_weights

        def update(self, named_tensors, version):
            install(self, named_tensors, version)
            g = torch.Generator().manual_seed(version)
            with torch.no_grad():
                for name, p in self.model.named_parameters():
                    if name.endswith("mlp.gate.weight"):
                        p.add_(torch.randn(p.shape, generator=g) * ROUTER_NOISE)
                for name, b in self.model.named_buffers():
                    if name.endswith("mlp.gate.e_score_correction_bias"):
                        b.add_(torch.randn(b.shape, generator=g) * BIAS_NOISE)

        HFEngine.update_weights = update
    return train(load_config(TrainConfig, str(RECIPE), overrides))


def _run(tiny, name: str, world: int, perturbed: bool = False, **extra) -> list[dict]:
    root, hf, data = tiny
    run_dir = root / name
    overrides = [f"model.hf_dir={hf}", f"data.train_files=[{data}]", f"run.dir={run_dir}"]
    # the tiny DeepSeek's max_position_embeddings is 128 (YaRN 4 x 32): the sequence budget stays within it
    overrides += ["model.max_sequence_length=128", "data.max_prompt_tokens=120"]
    overrides += [f"{k}={v}" for k, v in extra.items()]
    run_distributed(_train_rank, world, overrides, perturbed, timeout=1800)
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


@pytest.fixture(scope="module")
def replay_runs(tiny):
    """Against the perturbed engine: (EP1 one step with replay, EP2 three steps with replay, EP2 one step
    without)."""
    on = {"rollout.routing_replay": "true"}
    ep1 = _run(tiny, "replay_ep1", 1, True, **on, **{"train.steps": 1})
    ep2 = _run(tiny, "replay_ep2", 2, True, **on, **{"parallel.ep": 2})
    off = _run(
        tiny, "replay_off", 2, True, **{"parallel.ep": 2, "train.steps": 1, "rollout.routing_replay": "false"}
    )
    return ep1[0], ep2, off[0]


def test_three_srpo_steps_at_ep2_replay_the_engines_experts(replay_runs):
    ep1, rows, _ = replay_runs
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["train/skipped_steps"] == 0.0
        assert r["moe/topk_mismatch_share"] == 0.0, "replay: the engine's experts, every token and layer"
        assert r["moe/router_disagreement_share"] > 0.0, "the perturbed engine routes differently"
    assert ep1["moe/topk_mismatch_share"] == 0.0
    _same_first_step(rows[0], ep1)


def test_without_replay_the_mismatch_shows(replay_runs):
    _, rows, off = replay_runs
    assert off["reward/mean"] == rows[0]["reward/mean"], "same engine, same seed: the same rollouts"
    assert off["moe/topk_mismatch_share"] > 0.0
    assert off["moe/topk_mismatch_share"] == off["moe/router_disagreement_share"]
    assert rows[0]["logprob/gap_mean"] <= off["logprob/gap_mean"]
