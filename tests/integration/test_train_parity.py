"""Issue 28's diagnostics end to end in ``srpo train`` (tiny Qwen3, real Qwen vocabulary, CPU engine):

- ``rollout.parity_top_k``: the engine's top-K travels engine → Sample → scoring pass → metrics.jsonl;
  with the trainer's weights on the engine ``logprob/topk_kl_max`` is ~0 (fp32 both sides), and an engine
  whose output head is perturbed after every sync (a stand-in for an engine's kernel / precision
  differences) reads a KL orders of magnitude higher, beside a larger sampled-token gap (measured: 1.1e-17
  against 1.1e-4 per token);
- two training files (two benchmarks): ``reward/<benchmark>/mean`` and ``/accuracy`` whenever a step's
  batch holds both, consistent with ``reward/mean``;
- ``teacher/divergence_trend`` from the second step with SDPO tokens on.
"""

from __future__ import annotations

import json

import pytest
import torch

from srpo_megatron.testing.distributed import run_distributed
from tests.helpers.train import read_metrics, train_overrides

HEAD_NOISE = 0.05  # std of the noise added to the engine's lm_head after every sync


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from srpo_megatron.testing.tiny import write_tiny_run

    root, hf, _ = write_tiny_run(tmp_path_factory.mktemp("tiny_parity"), num_prompts=1)
    files = []
    for b in ("alpha", "beta"):  # data.rows.benchmark_name: <dir>/train.jsonl -> <dir>
        (root / b).mkdir()
        rows = [
            {"prompt": f"{b}: tell me a fact about {i}.", "system": None, "answer": "-", "kind": "coin"}
            for i in range(8)
        ]
        (root / b / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        files.append(str(root / b / "train.jsonl"))
    return root, hf, files


def _train_rank(rank, world, overrides, perturbed):
    from srpo_megatron.config import TrainConfig, load_config
    from srpo_megatron.rollout.hf_engine import HFEngine
    from srpo_megatron.train import train
    from tests.helpers.recipe import RECIPE

    if perturbed:
        install = HFEngine.update_weights

        def update(self, named_tensors, version):
            install(self, named_tensors, version)
            g = torch.Generator().manual_seed(version)
            with torch.no_grad():
                head = self.model.get_output_embeddings().weight
                head.add_(torch.randn(head.shape, generator=g) * HEAD_NOISE)

        HFEngine.update_weights = update
    return train(load_config(TrainConfig, str(RECIPE), overrides))


def _run(tiny, name, perturbed=False, **extra):
    root, hf, files = tiny
    run_dir = root / name
    ov = train_overrides((root, hf, files[0]), run_dir, **{"rollout.parity_top_k": 4, **extra})
    ov = [o if not o.startswith("data.train_files=") else f"data.train_files=[{','.join(files)}]" for o in ov]
    run_distributed(_train_rank, 1, ov, perturbed, timeout=900)
    return read_metrics(run_dir)


@pytest.fixture(scope="module")
def same(tiny):
    return _run(tiny, "same", **{"train.steps": 2})


def test_parity_kl_is_zero_with_the_trainers_weights(same):
    for r in same:
        assert r["logprob/gap_max"] < 1e-4, "engine and trainer hold the same weights"
        assert 0.0 <= r["logprob/topk_kl_mean"] <= r["logprob/topk_kl_max"] < 1e-6


def test_parity_kl_rises_on_a_perturbed_engine(tiny, same):
    (off,) = _run(tiny, "perturbed", True, **{"train.steps": 1})
    on = same[0]
    assert off["logprob/topk_kl_mean"] > 1e-5  # near-uniform tiny model: its top-4 hold little mass
    assert off["logprob/topk_kl_mean"] > 1e3 * max(on["logprob/topk_kl_mean"], 1e-9)
    assert off["logprob/gap_mean"] > on["logprob/gap_mean"]


def test_per_benchmark_reward_and_accuracy(same):
    seen = 0
    for r in same:
        keys = {k for k in r if k.startswith(("reward/alpha/", "reward/beta/"))}
        if not keys:
            continue  # a batch of one benchmark logs only reward/mean
        seen += 1
        assert keys == {f"reward/{b}/{m}" for b in ("alpha", "beta") for m in ("mean", "accuracy")}
        lo, hi = sorted((r["reward/alpha/mean"], r["reward/beta/mean"]))
        assert lo <= r["reward/mean"] <= hi, "the batch mean lies between the benchmarks' means"
    assert seen, "some step must draw prompts of both benchmarks for this test to mean anything"


def test_divergence_trend_follows_the_sdpo_steps(same):
    sdpo_steps = [r for r in same if r["tokens/sdpo_frac"] > 0]
    for i, r in enumerate(sdpo_steps):
        assert ("teacher/divergence_trend" in r) == (i >= 1)
    if len(sdpo_steps) == 2:
        a, b = (r["teacher/divergence_mean"] for r in sdpo_steps)
        assert sdpo_steps[1]["teacher/divergence_trend"] == pytest.approx(b - a, abs=1e-12)
