"""End-to-end ``srpo train`` of a tiny random Qwen3-MoE (4 experts, top-2, real Qwen vocabulary) with expert
parallelism, on gloo ranks with the CPU rollout engine.

- 3 SRPO steps at EP2 (world 2) and at TP2×EP2 (world 4, sequence parallel, routing replay on) complete,
  train, and log the MoE metrics every step; their first-step loss equals EP1's (≤ 1e-5).
- Rollout routing replay: with replay on, the trainer's top-k equals the engine's on every response token
  (mismatch share 0, also at TP2×EP2 where each TP rank routes its sequence-parallel chunk). The engine's
  routing is made to differ from the trainer's by perturbing the engine's router weights after every
  weight sync (a stand-in for bf16 / kernel differences of a real SGLang engine): then, with replay off,
  the mismatch share is > 0 (the metric can fail), and with replay on it is 0 while the trainer's own
  choice still disagrees, and the trainer-vs-engine log-prob gap is no larger.
- A checkpoint saved at EP2 loads at EP1 with identical logits: ``tests/dist/test_moe_conversion.py``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from srpo_megatron.testing.distributed import run_distributed

# Several multi-rank `srpo train` runs per fixture: 2 min 16 s for the file on 2 idle cores. It was `slow`
# (~15 min) while the EP2 run hung until its timeout: uneven passes across DP ranks
# (trainer/microbatches/lockstep.py).
pytestmark = [pytest.mark.moe, pytest.mark.timeout(2400)]

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
    from srpo_megatron.config import TrainConfig, load_config
    from srpo_megatron.train import train

    return train(load_config(TrainConfig, str(RECIPE), overrides))


ROUTER_NOISE = 0.3  # std of the noise added to the engine's router weights (theirs are drawn with std 0.5)


def _train_rank_perturbed_engine(rank, world, overrides):
    """``_train_rank`` with the CPU engine's routers perturbed after each weight update (rank 0 hosts it)."""
    from srpo_megatron.rollout.hf_engine import HFEngine

    install = HFEngine.update_weights

    def perturbed(self, named_tensors, version):
        install(self, named_tensors, version)
        g = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    p.add_(torch.randn(p.shape, generator=g) * ROUTER_NOISE)

    HFEngine.update_weights = perturbed
    return _train_rank(rank, world, overrides)


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _run(tiny, name: str, world: int, rank_fn=_train_rank, **extra) -> Path:
    run_dir = tiny[0] / name
    run_distributed(rank_fn, world, _overrides(tiny, run_dir, **extra), timeout=1800)
    return run_dir


@pytest.fixture(scope="module")
def ep1_run(tiny):
    return _run(tiny, "ep1", 1, **{"train.steps": 1})


@pytest.fixture(scope="module")
def ep2_run(tiny):
    return _run(tiny, "ep2", 2, **{"parallel.ep": 2})


@pytest.fixture(scope="module")
def tp2_ep2_run(tiny):
    return _run(tiny, "tp2ep2", 4, **{"parallel.ep": 2, "parallel.tp": 2, "rollout.routing_replay": "true"})


@pytest.fixture(scope="module")
def perturbed_runs(tiny):
    """One step at EP2 against an engine whose routers differ from the trainer's: (replay off, replay on)."""
    return tuple(
        _metrics(
            _run(
                tiny,
                f"perturbed_replay_{replay}",
                2,
                _train_rank_perturbed_engine,
                **{"parallel.ep": 2, "train.steps": 1, "rollout.routing_replay": replay},
            )
        )[0]
        for replay in ("false", "true")
    )


@pytest.fixture(scope="module")
def cp_replay_runs(tiny):
    """One packed step with replay against the perturbed engine, at CP1 (world 1) and CP2 (world 2)."""
    packed = {"train.steps": 1, "rollout.routing_replay": "true", "train.max_tokens_per_micro_batch": 64}
    return tuple(
        _metrics(
            _run(tiny, f"replay_cp{cp}", cp, _train_rank_perturbed_engine, **packed, **{"parallel.cp": cp})
        )[0]
        for cp in (1, 2)
    )


def _check_three_steps(tiny, run_dir: Path, tmp_path: Path) -> list[dict]:
    from srpo_megatron.conversion.checkpoint import megatron_to_hf

    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["train/skipped_steps"] == 0.0
        assert r["logprob/gap_max"] < 1e-4, "engine and trainer must hold the same weights"
        assert 1.0 <= r["moe/expert_load_max_over_mean"] <= 4 / 2, "4 experts, top-2: max/mean in [1, 2]"
        assert 0.0 < r["moe/router_entropy"] < math.log(4)
        for key in ("moe/topk_mismatch_share", "moe/router_disagreement_share"):
            assert 0.0 <= r[key] <= 1.0, key
    initial = load_file(str(tiny[1] / "model.safetensors"))
    megatron_to_hf(run_dir / "checkpoints" / "step_000003", tmp_path / "final", progress=lambda _: None)
    final = load_file(str(tmp_path / "final" / "model.safetensors"))
    assert initial.keys() == final.keys()
    experts = [k for k in initial if ".mlp.experts." in k]
    assert experts, "the export must carry per-expert tensors"
    moved = max((final[k] - initial[k]).abs().max().item() for k in experts)
    assert moved > 1e-5, "three optimizer steps must change the experts"
    return rows


def _same_routing_figures(row: dict, ep1: dict) -> None:
    """Same rollouts and weights: the routing figures summed over the ranks equal EP1's (a rank that
    left out its share of the tokens, e.g. a missing TP or DP sum, changes them)."""
    for key in ("moe/expert_load_max_over_mean", "moe/router_entropy"):
        assert row[key] == pytest.approx(ep1[key], rel=1e-6), key


def test_three_srpo_steps_at_ep2(tiny, ep1_run, ep2_run, tmp_path):
    rows = _check_three_steps(tiny, ep2_run, tmp_path)
    # No replay: the trainer's used top-k is its own choice, and with the engine's own weights (fp32 on both
    # sides) it agrees with the engine's report, position by position.
    assert all(r["moe/topk_mismatch_share"] == r["moe/router_disagreement_share"] for r in rows)
    assert all(r["moe/router_disagreement_share"] < 0.01 for r in rows)
    (ep1,) = _metrics(ep1_run)
    _same_routing_figures(rows[0], ep1)
    assert rows[0]["reward/mean"] == ep1["reward/mean"], "same seed, same weights: same rollouts"
    assert rows[0]["loss/total"] == pytest.approx(ep1["loss/total"], abs=1e-5)
    assert rows[0]["grad_norm"] == pytest.approx(ep1["grad_norm"], rel=1e-4)


def test_three_srpo_steps_at_tp2_ep2(tiny, ep1_run, tp2_ep2_run, tmp_path):
    rows = _check_three_steps(tiny, tp2_ep2_run, tmp_path)
    assert all(r["moe/topk_mismatch_share"] == 0.0 for r in rows), "replay: the engine's experts, every token"
    (ep1,) = _metrics(ep1_run)
    _same_routing_figures(rows[0], ep1)
    assert rows[0]["reward/mean"] == ep1["reward/mean"]
    assert rows[0]["loss/total"] == pytest.approx(ep1["loss/total"], abs=1e-5)
    assert rows[0]["grad_norm"] == pytest.approx(ep1["grad_norm"], rel=1e-4)


def test_replay_uses_the_engines_experts_and_the_metric_sees_a_perturbed_router(perturbed_runs):
    off, on = perturbed_runs
    assert off["reward/mean"] == on["reward/mean"], "same engine, same seed: the same rollouts"
    # Without replay the trainer routes by its own router, which the engine's no longer matches.
    assert off["moe/topk_mismatch_share"] > 0.0
    assert off["moe/topk_mismatch_share"] == off["moe/router_disagreement_share"]
    # With replay every response token of every layer takes the engine's experts, although the trainer's
    # own router would still choose differently (not exactly as often as without replay: from the second
    # layer on, its input comes from the replayed experts of the layers before).
    assert on["moe/topk_mismatch_share"] == 0.0
    assert on["moe/router_disagreement_share"] > 0.0
    assert on["logprob/gap_mean"] <= off["logprob/gap_mean"]
    assert on["logprob/gap_max"] <= off["logprob/gap_max"] + 1e-6


def test_replay_and_routing_metrics_at_context_parallel_2(cp_replay_runs):
    """At CP2 each rank routes its two chunks of every packed sequence: replay must give those tokens the
    engine's experts for their own positions, and the metrics must sum over the CP group. Same rollouts,
    same step as CP1 (the CP2 scoring pass used to fail on a map of the whole micro-batch)."""
    cp1, cp2 = cp_replay_runs
    assert cp2["reward/mean"] == cp1["reward/mean"], "same engine, same seed: the same rollouts"
    assert cp1["moe/topk_mismatch_share"] == 0.0 and cp2["moe/topk_mismatch_share"] == 0.0
    assert cp1["moe/router_disagreement_share"] > 0.0, "the perturbed engine routes differently"
    for key in ("moe/expert_load_max_over_mean", "moe/router_entropy", "moe/router_disagreement_share"):
        assert cp2[key] == pytest.approx(cp1[key], rel=1e-6), key
    assert cp2["logprob/gap_mean"] == pytest.approx(cp1["logprob/gap_mean"], rel=1e-4)
    assert cp2["loss/total"] == pytest.approx(cp1["loss/total"], abs=1e-5)
    assert cp2["grad_norm"] == pytest.approx(cp1["grad_norm"], rel=1e-4)
