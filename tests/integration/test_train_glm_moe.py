"""End-to-end ``srpo train`` of a tiny random GLM-4.5 (``write_tiny_glm_moe``: a dense first layer, 8 experts
top-2 + a shared expert, the sigmoid router with a nonzero e_score_correction_bias, routed_scaling_factor,
QK-norm, q/k/v bias, partial RoPE; real Qwen vocabulary) on gloo ranks with the CPU rollout engine.

The engine is made to route differently from the trainer: after every weight sync its routers' weights AND
expert biases are perturbed (a stand-in for the bf16 / kernel differences of a real SGLang engine).

- With routing replay on, 3 SRPO steps at EP2 complete, the trainer uses the engine's experts on every
  response token of every MoE layer (mismatch share 0) although its own sigmoid/bias router would choose
  differently, and the first step's loss equals EP1's (<= 1e-5) under the same replay.
- With replay off the mismatch share is > 0: the metric (and the replay) can fail.
- The expert bias is frozen (``moe.expert_bias_update_rate: 0``): the exported checkpoint after 3 steps has
  the initial e_score_correction_bias, bit for bit, while the experts moved.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from srpo_megatron.testing.distributed import run_distributed

pytestmark = [pytest.mark.moe, pytest.mark.timeout(2400)]

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "examples" / "tiny_cpu_test.yaml"
ROUTER_NOISE = 0.3  # std of the noise added to the engine's router weights (drawn with std 0.5)
BIAS_NOISE = 0.1  # std of the noise added to the engine's expert biases (drawn with std 0.3)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from srpo_megatron.testing.tiny import write_tiny_run

    return write_tiny_run(tmp_path_factory.mktemp("tiny_glm"), num_prompts=16, glm=True)


def _train_rank_perturbed_engine(rank, world, overrides):
    from srpo_megatron.config import TrainConfig, load_config
    from srpo_megatron.rollout.hf_engine import HFEngine
    from srpo_megatron.train import train

    install = HFEngine.update_weights

    def perturbed(self, named_tensors, version):
        install(self, named_tensors, version)
        g = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    p.add_(torch.randn(p.shape, generator=g) * ROUTER_NOISE)
            for name, b in self.model.named_buffers():
                if name.endswith("mlp.gate.e_score_correction_bias"):
                    b.add_(torch.randn(b.shape, generator=g) * BIAS_NOISE)

    HFEngine.update_weights = perturbed
    return train(load_config(TrainConfig, str(RECIPE), overrides))


def _run(tiny, name: str, world: int, **extra) -> Path:
    root, hf, data = tiny
    run_dir = root / name
    overrides = [f"model.hf_dir={hf}", f"data.train_files=[{data}]", f"run.dir={run_dir}"]
    overrides += [f"{k}={v}" for k, v in extra.items()]
    run_distributed(_train_rank_perturbed_engine, world, overrides, timeout=1800)
    return run_dir


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tiny):
    """(EP1 one step, EP2 three steps, EP2 one step without replay), all against the perturbed engine."""
    ep1 = _run(tiny, "ep1", 1, **{"train.steps": 1, "rollout.routing_replay": "true"})
    ep2 = _run(tiny, "ep2", 2, **{"parallel.ep": 2, "rollout.routing_replay": "true"})
    off = _run(tiny, "ep2_off", 2, **{"parallel.ep": 2, "train.steps": 1, "rollout.routing_replay": "false"})
    return ep1, ep2, off


def test_three_srpo_steps_at_ep2_replay_the_engines_experts(tiny, runs, tmp_path):
    from srpo_megatron.conversion.checkpoint import megatron_to_hf

    ep1_dir, ep2_dir, _ = runs
    rows = _metrics(ep2_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["train/skipped_steps"] == 0.0
        assert r["moe/topk_mismatch_share"] == 0.0, "replay: the engine's experts, every token and layer"
        assert r["moe/router_disagreement_share"] > 0.0, "the perturbed engine routes differently"
        assert 1.0 <= r["moe/expert_load_max_over_mean"] <= 8 / 2
        assert 0.0 < r["moe/router_entropy"] < math.log(8)
    (ep1,) = _metrics(ep1_dir)
    assert ep1["moe/topk_mismatch_share"] == 0.0
    assert rows[0]["reward/mean"] == ep1["reward/mean"], "same seed, same engine: same rollouts"
    assert rows[0]["loss/total"] == pytest.approx(ep1["loss/total"], abs=1e-5)
    assert rows[0]["grad_norm"] == pytest.approx(ep1["grad_norm"], rel=1e-4)

    initial = load_file(str(tiny[1] / "model.safetensors"))
    megatron_to_hf(ep2_dir / "checkpoints" / "step_000003", tmp_path / "final", progress=lambda _: None)
    final = load_file(str(tmp_path / "final" / "model.safetensors"))
    assert initial.keys() == final.keys()
    biases = [k for k in initial if k.endswith("e_score_correction_bias")]
    assert biases and all(torch.equal(final[k], initial[k]) for k in biases), "the expert bias is frozen"
    experts = [k for k in initial if ".mlp.experts." in k]
    assert max((final[k] - initial[k]).abs().max().item() for k in experts) > 1e-5


def test_without_replay_the_mismatch_shows(runs):
    _, ep2_dir, off_dir = runs
    (off,) = _metrics(off_dir)
    on = _metrics(ep2_dir)[0]
    assert off["reward/mean"] == on["reward/mean"], "same engine, same seed: the same rollouts"
    assert off["moe/topk_mismatch_share"] > 0.0
    assert off["moe/topk_mismatch_share"] == off["moe/router_disagreement_share"]
    assert on["logprob/gap_mean"] <= off["logprob/gap_mean"]
