"""Fidelity of the training step to the method (and to verl's conventions), on the real megatron path:

- π_old is scored once per rollout batch: with 4 mini-batches and a large LR, the later mini-batches
  train against the rollout batch's π_old, so their ratios differ from 1 and the PPO clip engages.
- The LR warm-up counts training steps (rollout batches), not optimizer steps.
- The budget clock of the eval log continues from the checkpoint after a resume.
"""

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

    return write_tiny_run(tmp_path_factory.mktemp("tiny_fidelity"), num_prompts=8)


def _samples(n: int):
    from srpo_megatron.trainer.step_types import Sample

    g = torch.Generator().manual_seed(3)
    out = []
    for m in range(n):
        resp = torch.randint(10, 2000, (6,), generator=g).tolist()
        out.append(Sample(m // 4, m % 4, [1, 2, 3, 4], resp, [-2.0] * 6, advantage=1.0 if m % 2 else -1.0))
    return out


def _mini_batches(rank, world, tiny, run_dir):
    from srpo_megatron.parallel import initialize_model_parallel
    from srpo_megatron.trainer.passes.learning import train_mini_batch
    from srpo_megatron.trainer.state.policy import Policy
    from srpo_megatron.trainer.passes.scoring import scoring_pass

    extra = ["loss.mode=grpo", "optim.lr=0.05", "optim.clip_grad=0.0", "train.mini_batches=4"]
    policy = Policy(tiny_config(tiny, run_dir, extra), initialize_model_parallel(1, 1, seed=1))
    scored = scoring_pass(policy, _samples(16))
    pi_old = scored.tokens.old_logp.clone()
    out = []
    for mini in scored.mini_batches(4):  # exactly what learning.learn does
        now = scoring_pass(policy, mini.samples).tokens.old_logp  # the policy before this step
        s = train_mini_batch(policy, mini)
        out.append(((now - mini.tokens.old_logp).abs().max().item(), s.grpo_clipped_sum / s.grpo_tokens))
    return out, torch.equal(pi_old, scored.tokens.old_logp)


def test_pi_old_is_the_rollout_batchs_for_every_mini_batch(tiny, tmp_path):
    per_mini, untouched = run_distributed(_mini_batches, 1, tiny, str(tmp_path))[0]
    assert untouched, "π_old must not be re-scored between mini-batches"
    (gap0, clip0), *later = per_mini
    assert gap0 == 0.0 and clip0 == 0.0, "the first mini-batch starts at ratio 1"
    for k, (gap, clip) in enumerate(later, start=2):
        assert gap > 1e-3, f"mini-batch {k}: log-ratio {gap} — not measured against the rollout batch's π_old"
        assert clip > 0.0, f"mini-batch {k}: no clipped token although the policy moved"


def _warmup(rank, world, tiny, run_dir):
    from srpo_megatron.parallel import initialize_model_parallel
    from srpo_megatron.trainer.passes.learning import learn
    from srpo_megatron.trainer.state.policy import Policy
    from srpo_megatron.trainer.passes.scoring import scoring_pass

    extra = [
        "loss.mode=grpo",
        "optim.lr=0.01",
        "optim.warmup_steps=4",
        "train.mini_batches=2",
        "train.steps=6",
    ]
    policy = Policy(tiny_config(tiny, run_dir, extra), initialize_model_parallel(1, 1, seed=1))
    lrs = []
    for _ in range(3):
        lrs.append(learn(policy, scoring_pass(policy, _samples(8)), 2).lr)
    return lrs


def test_warmup_counts_training_steps_not_optimizer_steps(tiny, tmp_path):
    lrs = run_distributed(_warmup, 1, tiny, str(tmp_path))[0]
    # Step s of warm-up W uses lr·s/W for both of its mini-batches (optimizer-step counting: 0, 2/4, 4/4).
    assert lrs == pytest.approx([0.0, 0.01 / 4, 0.01 * 2 / 4], abs=1e-12)


def _train(rank, world, tiny, run_dir, steps):
    from srpo_megatron.train import train

    _, _, data = tiny
    extra = [
        f"train.steps={steps}",
        "train.eval_at_ends=true",
        f"data.eval_files=[{data}]",
        "eval.k=1",
        "eval.max_new_tokens=2",
        "eval.max_prompts_per_benchmark=1",
        "eval.reward_workers=0",
    ]
    return train(tiny_config(tiny, run_dir, extra))


def _reseal(path: Path) -> None:
    from srpo_megatron.conversion.checkpoint_files import MANIFEST, file_digest

    manifest = path.parent / MANIFEST
    body = json.loads(manifest.read_text())
    body["files"][path.name] = file_digest(path)
    manifest.write_text(json.dumps(body))


def test_budget_clock_continues_after_resume(tiny, tmp_path):
    run_dir = tmp_path / "run"
    run_distributed(_train, 1, tiny, str(run_dir), 1)
    state_file = run_dir / "checkpoints" / "step_000001" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    assert state["budget_clock_s"] > 0
    state["budget_clock_s"] = 10_000.0  # as if the first run had taken 2.8 hours
    state_file.write_text(json.dumps(state))
    _reseal(state_file)  # the edit is deliberate: refresh its manifest entry so the checkpoint verifies
    run_distributed(_train, 1, tiny, str(run_dir), 2)
    log = [json.loads(x) for x in (run_dir / "eval_log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in log] == [0, 1, 2]
    assert log[0]["elapsed_s"] < 10_000.0
    assert log[-1]["elapsed_s"] >= 10_000.0, "the resumed run restarted its budget clock from zero"
