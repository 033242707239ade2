"""A bf16 checkpoint WITHOUT the distributed optimizer (the single-GPU default without TE) saves and
resumes exactly, on the real megatron path (CPU, one gloo rank).

The local spec's RMSNorm weights stay fp32 inside the bf16 model, and megatron's
``Float16OptimizerWithFloat16Params.sharded_state_dict`` cannot save such a model (compat/float16_optimizer.py
says why). Saved at step 2 and resumed, step 3 equals the uninterrupted run bit for bit: loss, bf16 params,
fp32 params, fp32 main params, Adam moments and step, teacher. Without the shim (planted) the save fails
with megatron's error; and once megatron saves such a model itself, the last test says to drop the shim.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from srpo_megatron.testing.distributed import RankFailed, run_distributed
from tests.dist.test_offload import _policy, _samples, tiny  # noqa: F401  (fixture)

EXTRA = ["model.params_dtype=bf16", "parallel.distributed_optimizer=false"]


def _state(policy) -> dict[str, list[torch.Tensor]]:
    from srpo_megatron.trainer import offload as off

    out: dict[str, list[torch.Tensor]] = {"step": [], "exp_avg": [], "exp_avg_sq": []}
    for opt in off._chained(policy.optimizer):
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                for k in out:
                    out[k].append(torch.as_tensor(opt.optimizer.state[p][k]).detach().clone().float())
    chained = off._chained(policy.optimizer)
    out["main"] = [m.detach().clone() for opt in chained for g in opt.fp32_from_float16_groups for m in g]
    out["params"] = [p.detach().clone() for p in policy.model.parameters()]
    out["teacher"] = [p.detach().clone() for p in policy.teacher.module.parameters()]
    return out


def _step(policy, rank: int, step: int) -> float:
    from srpo_megatron.trainer.learning import learn
    from srpo_megatron.trainer.scoring import score_rollouts

    stats = learn(policy, score_rollouts(policy, _samples(rank, step)), 1)
    policy.update_teacher()
    return stats.loss


def _run(rank, world, tiny, run_dir, interrupt, plant=False):  # noqa: F811
    from srpo_megatron.compat import float16_optimizer as shim
    from srpo_megatron.trainer.checkpoint import load_checkpoint, save_checkpoint

    if plant:  # today's megatron method, unfixed
        shim.needs_fix = lambda opt: False
    policy = _policy(tiny, run_dir, EXTRA)
    dtypes = {p.dtype for p in policy.model.parameters()}
    assert dtypes == {torch.bfloat16, torch.float32}, f"the case under test needs fp32 norms: {dtypes}"
    losses = [_step(policy, rank, step) for step in range(2)]
    before, loaded = _state(policy), None
    if interrupt:
        save_checkpoint(policy, run_dir, 2, {"weight_version": 2}, keep_last=2)
        policy = _policy(tiny, run_dir, EXTRA)
        load_checkpoint(policy, Path(run_dir) / "checkpoints" / "step_000002", log=lambda _: None)
        loaded = _state(policy)
    losses.append(_step(policy, rank, 2))
    return before, loaded, _state(policy), losses


def _unequal(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[int]:
    assert len(a) == len(b) > 0
    return [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if not torch.equal(x, y)]


def test_bf16_checkpoint_without_distributed_optimizer_resumes_exactly(tiny, tmp_path):  # noqa: F811
    [(_, _, straight, losses_a)] = run_distributed(_run, 1, tiny, str(tmp_path / "a"), False, timeout=900)
    resumed_run = run_distributed(_run, 1, tiny, str(tmp_path / "b"), True, timeout=900)
    [(saved, loaded, resumed, losses_b)] = resumed_run
    assert losses_a == losses_b, (losses_a, losses_b)
    for key in saved:  # what was saved is what is loaded
        assert not _unequal(saved[key], loaded[key]), f"{key} differs after load"
    for key in straight:  # and the next step equals the uninterrupted run's
        assert not _unequal(straight[key], resumed[key]), f"{key} after the resumed step differs"
    assert not torch.equal(straight["params"][0], saved["params"][0]), "step 3 must move the params"


def test_megatron_still_cannot_save_fp32_params_in_a_bf16_model(tiny, tmp_path):  # noqa: F811
    """Planted: without the shim the save fails. When this test fails, megatron saves such a model itself:
    delete srpo_megatron/compat/float16_optimizer.py and its use in trainer/checkpoint.py."""
    with pytest.raises(RankFailed, match="does not match any model sharded param"):
        run_distributed(_run, 1, tiny, str(tmp_path / "p"), True, True, timeout=900)
