"""Multi-turn rollouts through the production collection path (``RolloutService``: its worker, its pool,
``route_groups``) on the tiny Qwen3 with the CPU engine: ``rollout.environment`` set gives ``Sample``s with
a ``response_mask`` (tool turns 0) and the step's ``multiturn/*`` metrics; unset, the single-turn path is
untouched (no mask, no ``multiturn/*``).

Two stand-ins: the weight sync only relabels the version (the engine already serves the tiny model's
weights; syncs are tested elsewhere), and the sampling parameters gain a seeded eighth of the vocabulary as
stop ids so that the random tiny model ends its turns (it never emits ``<|im_end|>`` by itself).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from srpo_megatron.rollout.environments import EnvStep
from tests.helpers.recipe import tiny_config

ENV = "tests.unit.test_multi_turn_service:TwoToolTurns"


class TwoToolTurns:
    """A tool answer after each of the first two turns, then done."""

    def reset(self, row):
        self.turn = 0
        return []

    def step(self, text):
        self.turn += 1
        if self.turn >= 3:
            return EnvStep(done=True, reward=0.25)
        return EnvStep([{"role": "tool", "content": f"lookup {self.turn}: 7"}], tool_calls=1, reward=0.25)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from srpo_megatron.testing.tiny import write_tiny_run

    return write_tiny_run(tmp_path_factory.mktemp("tiny_mt"), num_prompts=4)


class _Relabel:
    """Weight-sync stand-in: the in-process engine keeps its weights and serves ``version``."""

    def push(self, engine, version, targets):
        engine._version = version
        return {}

    def engines_restarted(self, engines):
        pass

    def close(self):
        pass


def _batch(tiny, run_dir, monkeypatch, extra):
    from srpo_megatron.data.dataset import build_datasets
    from srpo_megatron.rewards import register_reward
    from srpo_megatron.rollout.factory import load_tokenizer
    from srpo_megatron.trainer.collect import rollout_service as rollouts

    register_reward("coin", "srpo_megatron.testing.tiny:coin_reward")
    sizes = ["rollout.prompts_per_step=2", "rollout.group_size=2", "rollout.max_new_tokens=96"]
    cfg = tiny_config(tiny, run_dir, [*sizes, *extra])
    tok = load_tokenizer(cfg.model.hf_dir)
    g = torch.Generator().manual_seed(0)
    stops = tuple(int(t) for t in torch.randperm(len(tok), generator=g)[: len(tok) // 8])
    real = rollouts.sampling_params
    monkeypatch.setattr(
        rollouts, "sampling_params", lambda *a, **k: dataclasses.replace(real(*a, **k), stop_token_ids=stops)
    )
    monkeypatch.setattr(rollouts, "build_weight_sync", lambda *a, **k: _Relabel())
    service = rollouts.RolloutService(cfg, tok, None, SimpleNamespace(host=None, dp_rank=0, dp_size=1))
    try:
        service.sync(1)
        prompts = list(build_datasets(cfg.data, tok)[0])[:2]
        return tok, service.collect(prompts, 0)
    finally:
        service.close()


def test_an_environment_gives_masked_samples_and_multi_turn_metrics(tiny, tmp_path, monkeypatch):
    tok, batch = _batch(tiny, tmp_path / "run", monkeypatch, [f"rollout.environment={ENV}"])
    assert len(batch.samples) == 4
    for s in batch.samples:
        assert s.response_mask is not None and len(s.response_mask) == len(s.response_ids)
        tool = [t for t, m in zip(s.response_ids, s.response_mask, strict=True) if m == 0]
        if s.finish_reason == "stop":  # three turns: two tool turns between them
            assert tok.decode(tool).count("<tool_response>") == 2
        assert all(lp == 0.0 for lp, m in zip(s.rollout_logp, s.response_mask, strict=True) if not m)
    m = batch.metrics
    assert m["multiturn/tool_calls"] >= 2 and m["multiturn/turns_max"] == 3
    assert 0 < m["multiturn/tool_token_frac"] < 1
    assert m["multiturn/tool_raised"] == m["multiturn/tool_timeouts"] == 0


def test_without_an_environment_the_single_turn_path_is_untouched(tiny, tmp_path, monkeypatch):
    _, batch = _batch(tiny, tmp_path / "run", monkeypatch, [])
    assert all(s.response_mask is None for s in batch.samples)
    assert not [k for k in batch.metrics if k.startswith("multiturn/")]
