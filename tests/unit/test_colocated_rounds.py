"""Dynamic sampling's extra rounds on a colocated SGLang engine: the engine serves every round of a step and
releases its memory once, after the step's last round (``RolloutService.next_batch``).

The service is the production one (``trainer/collect/rollout_service.py``: its worker, its pool, its
restart path) with
two stand-ins: the engine is the real ``SGLangEngine`` over ``SGLangMemoryRules`` (an in-process transport
that keeps SGLang's release/resume rules, ``tests/helpers/sglang.py``), and the weight sync streams a
fixed set of tensors into it through the engine's own ``update_weights`` (its resume order is the
engine's). The stand-in answers every request with the same token, so every group is uniform and never
carries signal: each step draws all ``rollout.max_sampling_rounds`` rounds and is then topped up.

The planted defect is the old order (release after every round, as the worker's after-job hook did): the
second round then meets a released engine, fails, and the engine is restarted; the test sees it.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from srpo_megatron.config import SGLangEngineConfig
from srpo_megatron.rollout.sglang.engine import SGLangEngine
from tests.helpers.recipe import tiny_config
from tests.helpers.sglang import SGLangMemoryRules

WEIGHTS = {"w": torch.ones(4, 4), "b": torch.zeros(4)}
ROUNDS = 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from srpo_megatron.testing.tiny import write_tiny_run

    return write_tiny_run(tmp_path_factory.mktemp("tiny_rounds"), num_prompts=16)


class _PushToEngine:
    """A ``WeightSync`` for one in-process engine: the fixed tensors through ``engine.update_weights``."""

    def push(self, engine, version, targets):
        engine.update_weights(WEIGHTS.items(), version)
        return {}

    def engines_restarted(self, engines):
        pass

    def close(self):
        pass


def _service(tiny, run_dir, monkeypatch):
    """The production ``RolloutService`` on one rank with an ``SGLangEngine`` over SGLang's memory rules;
    returns it and every transport it built (one per engine build)."""
    from srpo_megatron.rewards import register_reward
    from srpo_megatron.rollout.factory import load_tokenizer
    from srpo_megatron.trainer.collect import rollout_service as rollouts

    register_reward("coin", "srpo_megatron.testing.tiny:coin_reward")
    cfg = tiny_config(
        tiny,
        run_dir,
        [
            "rollout.dynamic_sampling=true",
            f"rollout.max_sampling_rounds={ROUNDS}",
            "rollout.prompts_per_step=2",
        ],
    )
    built: list[SGLangMemoryRules] = []

    def build(self):
        rules = SGLangMemoryRules()
        built.append(rules)
        sg = SGLangEngineConfig(mode="http", url="http://unused", model_path="/m", weight_sync="tensor")
        manifest = {n: tuple(t.shape) for n, t in WEIGHTS.items()}
        return SGLangEngine(sg, transport=rules, manifest=manifest, serializer=lambda data: "payload")

    monkeypatch.setattr(rollouts, "build_weight_sync", lambda *a, **k: _PushToEngine())
    monkeypatch.setattr(rollouts.RolloutService, "_build", build)
    groups = SimpleNamespace(host=None, dp_rank=0, dp_size=1)
    return rollouts.RolloutService(cfg, load_tokenizer(cfg.model.hf_dir), None, groups), built


def _train_steps(service, tiny, steps: int) -> list[dict]:
    """What ``train.py`` does with the service: sync the step's version, take the step's batch, train."""
    from srpo_megatron.data.dataset import build_datasets

    prompts = list(build_datasets(service.cfg.data, service.tokenizer)[0])
    draw = lambda n: [prompts.pop(0) for _ in range(n)]  # noqa: E731
    metrics = []
    for step in range(steps):
        service.sync(step + 1)
        metrics.append(service.next_batch(draw, step, step + 1).metrics)
    return metrics


def _replay(tiny, run_dir, monkeypatch):
    service, built = _service(tiny, run_dir, monkeypatch)
    try:
        metrics = _train_steps(service, tiny, 2)
    finally:
        service.close()
    return service, built, metrics


def _check(service, built, metrics) -> None:
    assert [m["sampling/rounds"] for m in metrics] == [ROUNDS, ROUNDS], "each step drew every round"
    assert service.restarts == 0 and len(built) == 1, "no round met a released engine"
    assert all(m["engine/restarts"] == 0 for m in metrics if "engine/restarts" in m)
    rules = built[0]
    assert not rules.dead
    every = [m for m, _ in rules.calls if m != "flush_cache"]
    # A round is one run of per-sample /generate calls (``SGLangEngine._generate_each``); two rounds meet
    # without a call between them, so a step's rounds show as one run (``sampling/rounds`` counts them).
    calls = [m for k, m in enumerate(every) if m != "generate" or k == 0 or every[k - 1] != "generate"]
    rounds_then_release = [
        "generate",  # every round on a serving engine
        "release_memory_occupation",  # once, when the step's batch is complete: training takes the memory
    ]
    first = ["update_weights_from_tensor", *rounds_then_release]  # nothing was released before the first
    later = [
        "resume_memory_occupation",  # weights, before the first bucket
        "update_weights_from_tensor",
        "resume_memory_occupation",  # KV cache and CUDA graphs, after the last bucket
        *rounds_then_release,
    ]
    assert calls == first + later, calls
    assert rules.paused == {"kv_cache", "weights", "cuda_graph"}, (
        "training runs with SGLang's memory released"
    )


def test_every_round_of_a_step_is_served_and_memory_is_released_once_per_step(tiny, tmp_path, monkeypatch):
    _check(*_replay(tiny, tmp_path / "run", monkeypatch))


def test_planted_release_after_every_round_is_caught(tiny, tmp_path, monkeypatch):
    from srpo_megatron.trainer.collect import off_policy

    run = off_policy.GenerationWorker._run

    def release_after_each_job(self, job):  # the old order: the worker released after every round
        result = run(self, job)
        self.engine().release_memory()
        return result

    monkeypatch.setattr(off_policy.GenerationWorker, "_run", release_after_each_job)
    service, built, metrics = _replay(tiny, tmp_path / "run", monkeypatch)
    assert service.restarts > 0, "the old order restarts the engine at the second round"
    with pytest.raises(AssertionError):
        _check(service, built, metrics)
