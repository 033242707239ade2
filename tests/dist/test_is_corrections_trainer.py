"""The off-policy corrections through the real scoring and learning passes (one rank, the tiny policy):
``scoring_pass(..., trainer_version=...)`` marks stale tokens from ``Sample.token_versions`` and clears
them (and MIS rejections under ``loss.is_rejection_denominator: drop``) from the batch's mask before any
normaliser is counted; under ``keep`` the MIS-rejected rows stay in the mask and in N_tokens."""

from __future__ import annotations

import pytest
import torch

from srpo_megatron.testing.distributed import run_distributed
from tests.helpers.recipe import tiny_config


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from srpo_megatron.testing.tiny import write_tiny_run

    return write_tiny_run(tmp_path_factory.mktemp("tiny_iscorr"), num_prompts=8)


def _samples(rollout_logp=None):
    from srpo_megatron.trainer.step_types import Sample

    # trainer version 5, bound 0 (on-policy recipe): tokens of versions < 5 are stale
    versions = [[5, 5, 5], [4, 5, 5], [3, 4, 5], None]
    return [
        Sample(
            0,
            m,
            [1, 2, 3],
            [4 + m, 5, 6],
            [-1.0, -6.0, -1.0] if rollout_logp is None else rollout_logp[3 * m : 3 * m + 3],
            reward=float(m % 2),
            advantage=m % 2 - 0.5,
            weight_version=5 if m != 3 else 2,
            token_versions=versions[m],
        )
        for m in range(4)
    ]


def _score_and_learn(rank, world, tiny, run_dir):
    from srpo_megatron.parallel import initialize_model_parallel
    from srpo_megatron.trainer.passes.learning import learn
    from srpo_megatron.trainer.state.policy import Policy
    from srpo_megatron.trainer.passes.scoring import scoring_pass

    out = {}
    groups = initialize_model_parallel(1, 1, seed=1)
    rollout_logp = None
    for name, extra in {
        "stale": ["loss.mask_stale_tokens=true"],
        "mis": ["loss.is_correction=mis", "loss.is_low=0.9", "loss.is_high=1.1"],
        "mis_keep": [
            "loss.is_correction=mis",
            "loss.is_low=0.9",
            "loss.is_high=1.1",
            "loss.is_rejection_denominator=keep",
        ],
    }.items():
        policy = Policy(tiny_config(tiny, f"{run_dir}/{name}", ["loss.mode=grpo", *extra]), groups)
        scored = scoring_pass(policy, _samples(rollout_logp), trainer_version=5)
        t = scored.tokens
        # the next policy starts from the same weights: engine log-probs ratios 1, e^−0.5, e^0.5 to π_old
        rollout_logp = (t.old_logp.double() + torch.tensor([0.0, 0.5, -0.5] * 4).double()).tolist()
        ratio = (t.old_logp.double() - t.rollout_logp.double()).exp()
        learned = learn(policy, scored, 1)
        out[name] = (t.mask.clone(), ratio, scored.stats, learned)
        if name == "stale":
            try:
                scoring_pass(policy, _samples())  # no trainer version: staleness unknown
            except ValueError as e:
                out["unknown"] = str(e)
    return out


def test_scoring_clears_stale_and_mis_rejected_tokens_before_training(tiny, tmp_path):
    out = run_distributed(_score_and_learn, 1, tiny, str(tmp_path))[0]
    mask, _, stats, learned = out["stale"]
    stale = [False] * 3 + [True, False, False] + [True, True, False] + [True] * 3
    assert mask.tolist() == [not s for s in stale]
    assert stats.stale_tokens == stats.rejected_tokens == sum(stale)
    assert learned.tokens == 12 - sum(stale)  # the training pass's token count: the kept tokens only
    assert "trainer_version" in out["unknown"]

    mask, ratio, stats, learned = out["mis"]
    inside = (ratio >= 0.9) & (ratio <= 1.1)
    assert 0 < int(inside.sum()) < 12, ratio  # the engine log-probs put tokens on both sides
    assert torch.equal(mask, inside)
    assert stats.rejected_tokens == 12 - int(inside.sum()) and stats.stale_tokens == 0
    assert learned.tokens == int(inside.sum())

    # keep: the same rejections, but the rejected rows stay in the mask and in N_tokens, so the same token
    # losses are divided by all 12 tokens instead of the kept ones (slime's and miles' denominators): the
    # gradient shrinks by n_kept / 12 (the loss itself is 0 here: the kept tokens' advantages cancel)
    drop_norm, n_inside = learned.grad_norm_sum, int(inside.sum())
    assert drop_norm > 0.0
    mask, ratio_keep, stats, learned = out["mis_keep"]
    assert torch.equal(ratio_keep, ratio) and bool(mask.all())
    assert stats.rejected_tokens == 12 - n_inside and learned.tokens == n_inside
    assert abs(learned.grad_norm_sum * 12 - drop_norm * n_inside) <= 1e-4 * drop_norm * n_inside
