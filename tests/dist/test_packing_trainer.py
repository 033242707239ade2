"""A full SRPO step (scoring pass, teacher scoring, training pass, optimizer step) gives the same result
with token-budget packed micro-batches as with right-padded ones, on the real megatron path.

Checked at two budgets (about two sequences per micro-batch, and all in one), at TP1 and at PP2 (where every
packed micro-batch is padded to the budget): π_old, the teacher's top-K + tail log-probs and entropies of
the scoring pass, the step's loss and per-branch sums, and every parameter after the optimizer step
(≤ 1e-5). The samples have different prompt and response lengths, and half of them take the SDPO branch
with a teacher prompt longer than the student's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from srpo_megatron.testing.distributed import run_distributed
from tests.helpers.trainer import packing_samples

pytestmark = pytest.mark.packing

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "examples" / "tiny_cpu_test.yaml"
BUDGETS = (0, 24, 400)  # 0 = padded micro-batches (the reference); 24: about two per micro-batch


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from srpo_megatron.testing.tiny import write_tiny_run

    return write_tiny_run(tmp_path_factory.mktemp("tiny_packing"), num_prompts=8)


def _step(rank, world, tiny, run_dir, pp, budgets, extra=()):
    from srpo_megatron.config import load_config
    from srpo_megatron.parallel import initialize_model_parallel
    from srpo_megatron.config import TrainConfig
    from srpo_megatron.trainer.passes.learning import learn
    from srpo_megatron.trainer.state.policy import Policy
    from srpo_megatron.trainer.passes.scoring import scoring_pass

    _, hf, data = tiny
    out = []
    groups = initialize_model_parallel(1, pp, seed=1)
    for budget in budgets:
        ov = [
            f"model.hf_dir={hf}",
            f"data.train_files=[{data}]",
            f"run.dir={run_dir}/{budget}",
            f"parallel.pp={pp}",
            "loss.mode=srpo",
            "optim.lr=0.01",
            "optim.warmup_steps=0",
            "train.micro_batch_size=3",
            f"train.max_tokens_per_micro_batch={budget}",
            *extra,
        ]
        policy = Policy(load_config(TrainConfig, str(RECIPE), ov), groups)
        scored = scoring_pass(policy, packing_samples())
        t = scored.tokens
        kept = None if t is None else (t.old_logp, t.teacher_logp, t.teacher_entropy)
        stats = learn(policy, scored, 1)
        params = {n: p.detach().float().clone() for n, p in policy.model.named_parameters()}
        out.append((kept, stats.loss if groups.is_last_stage else None, stats.sdpo_loss_sum, params))
    return out


@pytest.mark.parametrize(
    "pp,aggregation", [(1, "token_mean"), (2, "token_mean"), (1, "seq_mean_token_mean")]
)
def test_packed_step_equals_padded_step(tiny, tmp_path, pp, aggregation):
    """``seq_mean_token_mean``: the samples' 1/|y_i| travel with their rows into packed micro-batches that
    group them differently from the padded ones (3 per micro-batch), and N_seq is the batch's."""
    extra = (f"loss.aggregation={aggregation}",)
    results = run_distributed(_step, pp, tiny, str(tmp_path), pp, BUDGETS, extra, timeout=900)
    last = results[-1]
    (ref_kept, ref_loss, ref_sdpo, _), *packed = last
    assert ref_sdpo != 0.0, "the reference step has no SDPO loss: the test would not see the teacher path"
    for budget, (kept, loss, sdpo, _) in zip(BUDGETS[1:], packed, strict=True):
        for name, got, want in zip(
            ("π_old", "teacher log-probs", "teacher entropy"), kept, ref_kept, strict=True
        ):
            diff = (got - want).abs().max().item()
            assert diff <= 1e-5, f"PP{pp} budget {budget}: {name} differs by {diff}"
        assert loss == pytest.approx(ref_loss, abs=1e-6), f"PP{pp} budget {budget}: loss"
        assert sdpo == pytest.approx(ref_sdpo, abs=1e-5), f"PP{pp} budget {budget}: SDPO loss sum"
    for stage in results:  # every pipeline stage's parameters after the optimizer step
        ref_params = stage[0][3]
        for budget, (_, _, _, params) in zip(BUDGETS[1:], stage[1:], strict=True):
            for name, want in ref_params.items():
                diff = (params[name] - want).abs().max().item()
                assert diff <= 1e-5, (
                    f"PP{pp} budget {budget}: parameter {name} differs by {diff} after the step"
                )
