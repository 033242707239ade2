"""``trainer/step_types.py`` and the rank-0 routing step that builds its samples.

- ``step_types`` is a leaf: importing it loads no other srpo_megatron module.
- ``route_rollouts`` builds every ``Sample`` once, frozen, with the reward, advantage, routing and teacher
  context that ``losses.route``/``group_advantages`` give for the batch's float64 rewards.
- One name, one meaning: a metric produced twice in a step (``time/reward_s`` by the pool and by the
  routing step, before) is refused, and so is a name ``METRICS`` does not declare, by the logger too.
- ``engine_metrics`` reduces the per-engine figures as declared (min / max over engines).
- ``TrainerState`` writes the checkpoint's trainer state with the keys earlier versions wrote, and reads
  them back exactly (an old checkpoint without ``budget_clock_s`` too).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from srpo_megatron.config import LossConfig, RolloutConfig, TeacherConfig
from srpo_megatron.data.dataset import Prompt
from srpo_megatron.data.rows import Row
from srpo_megatron.losses import group_advantages, route, routing_masks
from srpo_megatron.rewards import register_reward
from srpo_megatron.rewards.pool import RewardPool, RewardResult
from srpo_megatron.rollout.base import Completion
from srpo_megatron.trainer.collect.rollout_service import EngineShare, RoundFigures, engine_metrics
from srpo_megatron.trainer.step_types import (
    METHOD_METRICS,
    METRICS,
    Sample,
    TrainerState,
    merge_metrics,
    reduce_values,
)
from tests.helpers.rollout_batch import route_rollouts
from tests.helpers.sample_pool import CharTokenizer as _Tokenizer


def test_step_types_is_a_leaf():
    code = "import sys, srpo_megatron.trainer.step_types; print([m for m in sys.modules if m[:5] == 'srpo_'])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert eval(out) == ["srpo_megatron", "srpo_megatron.trainer", "srpo_megatron.trainer.step_types"]


def _routed(monkeypatch=None):
    register_reward("coin", "srpo_megatron.testing.tiny:coin_reward")
    tok = _Tokenizer()
    prompts = [
        Prompt(tuple(ord(c) for c in f"q{i}"), Row(f"question {i}", None, "-", "coin", "b", f"f:{i}"))
        for i in range(3)
    ]
    g = 4
    completions = [
        [
            Completion(
                i,
                [ord(c) for c in f"answer {i}" + "!" * j],  # coin rewards: mixed in every group
                [-0.5] * (8 + j),
                "length" if j == 3 else "stop",
                routed_experts=torch.full((5, 2, 2), 300 if j == 0 else j) if i == 0 else None,
            )
            for j in range(g)
        ]
        for i in range(3)
    ]
    rollout, loss = RolloutConfig(prompts_per_step=3, group_size=g), LossConfig()
    with RewardPool(0, 30.0) as pool:
        batch = route_rollouts(tok, prompts, completions, rollout, loss, TeacherConfig(), pool, t_gen=1.5)
    return tok, prompts, completions, loss, batch


def test_route_rollouts_builds_every_sample_once_frozen_with_rewards_routing_and_teacher_context():
    from srpo_megatron.testing.tiny import coin_reward

    tok, prompts, completions, loss, batch = _routed()
    assert [(s.group, s.member) for s in batch.samples] == [(i, j) for i in range(3) for j in range(4)]
    r = torch.tensor(
        [[coin_reward(tok.decode(c.token_ids, True), "-") for c in group] for group in completions],
        dtype=torch.float64,
    )
    routing = route(r, loss.success_threshold)
    grpo, sdpo, needs = routing_masks(routing, loss.mode)
    adv = group_advantages(r, loss.std_normalize, loss.std_eps)
    assert bool(needs.any()), "the coin rewards route some sample to the teacher"
    for s in batch.samples:
        i, j = s.group, s.member
        assert (s.reward, s.advantage) == (float(r[i, j]), float(adv[i, j]))
        assert (s.grpo, s.sdpo, s.needs_teacher) == (bool(grpo[i, j]), bool(sdpo[i, j]), bool(needs[i, j]))
        assert s.response_ids == completions[i][j].token_ids and s.prompt_ids == list(prompts[i].ids)
        assert s.finish_reason == ("length" if j == 3 else "stop")
        if s.needs_teacher:
            sibling = tok.decode(completions[i][int(routing.sibling[i, j])].token_ids, True)
            assert sibling in tok.decode(s.teacher_prompt_ids, True)
        else:
            assert s.teacher_prompt_ids is None
        with pytest.raises(dataclasses.FrozenInstanceError):
            s.reward = 2.0  # type: ignore[misc]
    experts = [s.routed_experts for s in batch.samples]
    assert experts[0].dtype == torch.int16 and experts[1].dtype == torch.uint8  # compacted per sample
    assert torch.equal(experts[2], torch.full((5, 2, 2), 2, dtype=torch.uint8)) and experts[4] is None
    assert batch.metrics["time/generate_s"] == 1.5 and batch.metrics["response/truncated_frac"] == 0.25
    assert {"time/reward_s", "reward/timeouts", "reward/errors"} <= set(batch.metrics)


def test_a_metric_produced_twice_or_undeclared_is_refused():
    pool = RewardResult([1.0], seconds=2.0).metrics()
    assert "time/reward_s" not in pool, "time/reward_s is the routing step's timer; the pool must not set it"
    merge_metrics({"time/reward_s": 1.0}, pool)
    with pytest.raises(KeyError, match=r"produced twice.*time/reward_s|time/reward_s.*produced twice"):
        merge_metrics({"time/reward_s": 1.0}, {**pool, "time/reward_s": 2.0})  # the overwrite it was
    with pytest.raises(KeyError, match="not declared"):
        merge_metrics({"reward/typo": 1.0})


def test_the_logger_refuses_an_undeclared_metric(tmp_path):
    from srpo_megatron.trainer.observe.metrics import MetricsLogger

    run = SimpleNamespace(tensorboard=False, wandb_project=None, progress_bar=False)
    logger = MetricsLogger(tmp_path, run, total=1, start=0)
    logger.log(1, {"reward/mean": 0.5})
    with pytest.raises(KeyError, match="reward/meen"):
        logger.log(2, {"reward/meen": 0.5})
    logger.close()
    assert [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        {"step": 1, "reward/mean": 0.5}
    ]


def test_every_metric_declares_a_reduction_and_the_method_set_is_unchanged():
    assert {m.reduce for m in METRICS.values()} <= {"mean", "sum", "max", "min", "last"}
    assert all(name == m.name and m.doc for name, m in METRICS.items())
    assert len(METHOD_METRICS) == 23 and "time/reward_s" in METHOD_METRICS
    assert [reduce_values(h, [3.0, 1.0, 2.0]) for h in ("sum", "max", "min", "mean", "last")] == [
        6.0,
        3.0,
        1.0,
        2.0,
        2.0,
    ]


def test_engine_metrics_reduce_over_engines_as_declared():
    def share(k, n, tokens, seconds, aborted=0):
        group = [Completion(0, [1] * tokens, [0.0] * tokens, "stop") for _ in range(n)]
        return RoundFigures.of(EngineShare(k, 0, range(k, k + 1), [group], seconds, aborted=aborted))

    m = engine_metrics([share(0, 4, 3, 2.0, aborted=3), share(1, 2, 5, 1.0, aborted=1)], sync_s=0.25)
    assert m == {
        "rollout/engines": 2.0,
        "rollout/samples_per_engine_min": 2.0,
        "rollout/samples_per_engine_max": 4.0,
        "rollout/response_tokens_per_engine_min": 10.0,
        "rollout/response_tokens_per_engine_max": 12.0,
        "rollout/engine_seconds_max": 2.0,
        "rollout/sync_s": 0.25,
        "rollout/aborted": 4.0,  # summed over engines
    }


def test_trainer_state_round_trips_the_checkpoint_json_with_the_earlier_keys():
    st = TrainerState(step=3, weight_version=4, sampler={"epoch": 1, "pos": 2}, budget_clock_s=0.0)
    st.evals.append({"acc": 0.5})
    st.sdpo_fracs.extend([0.25, 0.5, 0.125])
    saved = st.to_checkpoint({"epoch": 1, "pos": 6}, 12.5)
    assert list(saved) == [
        "weight_version",
        "sampler",
        "history",
        "budget_clock_s",
        "next_dispatch",
        "teacher_watch",
    ]
    assert saved["history"] == {"evals": [{"acc": 0.5}], "sdpo_fracs": [0.25, 0.5, 0.125]}
    on_disk = json.loads(json.dumps({**saved, "scheduler": {}, "step": 3}, default=float))  # save_checkpoint
    back = TrainerState.from_checkpoint(on_disk)
    assert back == dataclasses.replace(st, sampler={"epoch": 1, "pos": 6}, budget_clock_s=12.5)
    del on_disk["budget_clock_s"]  # written before the budget clock existed
    assert TrainerState.from_checkpoint(on_disk).budget_clock_s == 0.0
    del on_disk["next_dispatch"]  # written before rollout rounds were counted: one round per step
    assert TrainerState.from_checkpoint(on_disk).next_dispatch is None
    del on_disk["teacher_watch"]  # written before the divergence trend existed: a fresh window
    assert TrainerState.from_checkpoint(on_disk).teacher_watch is None


def test_sample_keyword_construction_keeps_defaults():
    s = Sample(0, 1, [1], [2, 3], [-1.0, -1.0], advantage=0.5)
    assert (s.reward, s.grpo, s.sdpo, s.needs_teacher, s.teacher_prompt_ids, s.routed_experts) == (
        0.0,
        True,
        False,
        False,
        None,
        None,
    )
