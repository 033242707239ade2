"""The trainer survives bad steps: a non-finite loss skips the step with the weights untouched, and a batch
with no signal (every group uniform) trains without dividing by zero."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from srpo_megatron.testing.distributed import run_distributed
from tests.helpers.recipe import tiny_config



@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from srpo_megatron.testing.tiny import write_tiny_run

    return write_tiny_run(tmp_path_factory.mktemp("tiny_robust"), num_prompts=8)


def _nonfinite_step(rank, world, tiny, run_dir):
    from srpo_megatron.parallel import initialize_model_parallel
    from srpo_megatron.trainer.passes.learning import train_mini_batch
    from srpo_megatron.trainer.state.policy import Policy
    from srpo_megatron.trainer.passes.scoring import scoring_pass
    from srpo_megatron.trainer.step_types import Sample

    cfg = tiny_config(tiny, run_dir, ["loss.mode=grpo"])
    groups = initialize_model_parallel(1, 1, seed=1)
    policy = Policy(cfg, groups)
    samples = [
        Sample(0, m, [1, 2, 3], [4, 5], [-1.0, -1.0], reward=float(m % 2), advantage=m % 2 - 0.5)
        for m in range(4)
    ]
    scored = scoring_pass(policy, samples)
    before = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    scored.tokens.old_logp[:2] = float("nan")  # a poisoned batch: sample 0's π_old
    out = train_mini_batch(policy, scored)
    unchanged = all(torch.equal(before[n], p) for n, p in policy.model.named_parameters())
    ok = train_mini_batch(policy, scoring_pass(policy, samples))
    moved = any(not torch.equal(before[n], p) for n, p in policy.model.named_parameters())
    return out.skipped, unchanged, ok.skipped, moved


def test_nonfinite_loss_skips_the_step_and_keeps_the_weights(tiny, tmp_path):
    skipped, unchanged, skipped_after, moved = run_distributed(_nonfinite_step, 1, tiny, str(tmp_path))[0]
    assert skipped == 1.0 and unchanged
    assert skipped_after == 0.0 and moved, "a finite batch afterwards must train normally"


def _teacher_on_skipped_step(rank, world, tiny, run_dir):
    from srpo_megatron.parallel import initialize_model_parallel
    from srpo_megatron.trainer.passes.learning import learn
    from srpo_megatron.trainer.state.policy import Policy
    from srpo_megatron.trainer.passes.scoring import scoring_pass
    from srpo_megatron.trainer.step_types import Sample

    cfg = tiny_config(tiny, run_dir, ["teacher.kind=ema", "teacher.ema_alpha=0.25"])
    groups = initialize_model_parallel(1, 1, seed=1)
    policy = Policy(cfg, groups)
    samples = [
        Sample(0, m, [1, 2, 3], [4, 5], [-1.0, -1.0], reward=float(m % 2), advantage=m % 2 - 0.5)
        for m in range(4)
    ]
    weights = lambda m: {n: p.detach().clone().double() for n, p in m.named_parameters()}  # noqa: E731
    theta0 = weights(policy.model)
    good = learn(policy, scoring_pass(policy, samples), 1)  # a good step: the teacher lags the student
    ran_good = policy.update_teacher_after(good)
    theta1, t_good = weights(policy.model), weights(policy.teacher.module)
    poisoned = scoring_pass(policy, samples)
    poisoned.tokens.old_logp[:2] = float("nan")
    bad = learn(policy, poisoned, 1)
    ran_bad = policy.update_teacher_after(bad)
    flags = (good.stepped, ran_good, bad.skipped, bad.stepped, ran_bad)
    return flags, theta0, theta1, t_good, weights(policy.model), weights(policy.teacher.module)


def test_a_skipped_step_leaves_the_ema_teacher_bit_identical(tiny, tmp_path):
    """SDPO (verl dp_actor.update_policy) updates its EMA teacher only after an applied optimizer step. A
    good step moves the teacher by the EMA of the student (independent float64 recomputation); a step
    skipped as non-finite afterwards leaves student and teacher bit-identical (an EMA update there would
    pull the lagging teacher towards the student)."""
    flags, theta0, theta1, t_good, theta_bad, t_bad = run_distributed(
        _teacher_on_skipped_step, 1, tiny, str(tmp_path)
    )[0]
    for n in theta0:  # θ′ = (1−α)θ0 + αθ1
        expected = 0.75 * theta0[n] + 0.25 * theta1[n]
        assert (t_good[n] - expected).abs().max().item() <= 1e-6, n
    assert any(not torch.equal(t_good[n], theta1[n]) for n in t_good), "the teacher must lag the student"
    assert all(torch.equal(theta1[n], theta_bad[n]) for n in theta1), "the skipped step moved the student"
    assert all(torch.equal(t_good[n], t_bad[n]) for n in t_good), "the skipped step moved the EMA teacher"
    assert flags == (1.0, True, 1.0, 0.0, False), flags


def _train(rank, world, tiny, run_dir):
    from srpo_megatron.train import train

    extra = ['rollout.reward_fns={coin: "srpo_megatron.testing.tiny:zero_reward"}', "train.steps=1"]
    return train(tiny_config(tiny, run_dir, extra))


def test_zero_signal_batch_trains_without_dividing_by_zero(tiny, tmp_path):
    run_distributed(_train, 1, tiny, str(tmp_path / "run"))
    (row,) = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert row["reward/mean"] == 0.0 and row["route/sdpo_frac"] == 0.0
    assert row["route/fallback_frac"] == 1.0
    assert row["loss/total"] == 0.0 and row["grad_norm"] == 0.0
    assert row["train/skipped_steps"] == 0.0


def _teacher_update(rank, world, tiny, run_dir, kind):
    from srpo_megatron.parallel import initialize_model_parallel
    from srpo_megatron.trainer.passes.learning import learn
    from srpo_megatron.trainer.state.policy import Policy
    from srpo_megatron.trainer.passes.scoring import scoring_pass
    from srpo_megatron.trainer.step_types import Sample

    cfg = tiny_config(tiny, run_dir, [f"teacher.kind={kind}", "teacher.ema_alpha=0.25"])
    groups = initialize_model_parallel(1, 1, seed=1)
    policy = Policy(cfg, groups)
    theta0 = {n: p.detach().clone().double() for n, p in policy.model.named_parameters()}
    samples = [
        Sample(0, m, [1, 2, 3], [4, 5], [-1.0, -1.0], reward=float(m % 2), advantage=m % 2 - 0.5)
        for m in range(4)
    ]
    learn(policy, scoring_pass(policy, samples), 1)
    policy.update_teacher()
    theta1 = {n: p.detach().double() for n, p in policy.model.named_parameters()}
    teacher = {n: p.detach().double() for n, p in policy.teacher.module.named_parameters()}
    return theta0, theta1, teacher


@pytest.mark.parametrize("kind", ["ema", "frozen"])
def test_teacher_update_is_the_ema_of_the_student_or_frozen(tiny, tmp_path, kind):
    theta0, theta1, teacher = run_distributed(_teacher_update, 1, tiny, str(tmp_path), kind)[0]
    assert any(not torch.equal(theta0[n], theta1[n]) for n in theta0), "the student must have moved"
    alpha = 0.25 if kind == "ema" else 0.0
    for n in theta0:  # independent float64 recomputation of θ′ = (1−α)θ0 + αθ1
        expected = (1 - alpha) * theta0[n] + alpha * theta1[n]
        assert (teacher[n] - expected).abs().max().item() <= 1e-6, n


def _train_kind(rank, world, tiny, run_dir, kind):
    from srpo_megatron.train import train

    return train(tiny_config(tiny, run_dir, [f"teacher.kind={kind}", "train.steps=1"]))


def test_trust_region_teacher_runs_on_the_sdpo_samples(tiny, tmp_path):
    run_distributed(_train_kind, 1, tiny, str(tmp_path / "run"), "trust_region")
    (row,) = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert row["samples/teacher_forward"] == row["samples/routed_to_teacher"] > 0
    assert row["teacher/entropy_mean"] > 0 and row["loss/sdpo"] != 0.0


def _engine_dies(rank, world, tiny, run_dir):
    from srpo_megatron.data.dataset import build_datasets
    from srpo_megatron.parallel import initialize_model_parallel
    from srpo_megatron.rewards import register_reward
    from srpo_megatron.rollout.factory import load_tokenizer
    from srpo_megatron.trainer.state.policy import Policy
    from srpo_megatron.trainer.collect.rollout_service import RolloutService

    cfg = tiny_config(tiny, run_dir)
    register_reward("coin", "srpo_megatron.testing.tiny:coin_reward")
    groups = initialize_model_parallel(1, 1, seed=1)
    tokenizer = load_tokenizer(cfg.model.hf_dir)
    prompts = list(build_datasets(cfg.data, tokenizer)[0])[:4]
    policy = Policy(cfg, groups)
    service = RolloutService(cfg, tokenizer, policy, groups)
    service.sync(3)
    first = service.collect(prompts, step=0)
    service.engine.shutdown()  # a real engine failure: it refuses to generate from now on
    again = service.collect(prompts, step=0)
    served = service.engine.weight_version
    service.close()
    tokens = lambda b: [s.response_ids for s in b.samples]  # noqa: E731
    return service.restarts, served, tokens(first) == tokens(again)


@pytest.mark.engine_faults  # restarts an engine on purpose
def test_a_dead_engine_is_restarted_and_resynced(tiny, tmp_path):
    restarts, served, same = run_distributed(_engine_dies, 1, tiny, str(tmp_path))[0]
    assert restarts == 1
    assert served == 3, "the new engine must serve the trainer's current weight version"
    assert same, "same weights and seed after the resync: the retried rollouts are identical"
