"""A checkpoint of the distributed optimizer (every GPU recipe's) resumes exactly: DP 2, bf16 params with
fp32 main params, the next step after loading equals the uninterrupted run's step (params, main params,
Adam moments and step), on the real megatron path (CPU, gloo). Without the step-untying shim
(trainer/run/checkpoint.py ``untie_torch_adam_steps``) the resumed step differs: planted below."""

from __future__ import annotations

from pathlib import Path

import torch

from srpo_megatron.testing.distributed import run_distributed
from tests.helpers.trainer import tiny, tiny_policy, tiny_step  # noqa: F401  (fixture)

EXTRA = ["model.params_dtype=bf16"]


def _optimizer_state(policy) -> dict[str, list[torch.Tensor]]:
    from srpo_megatron.trainer.state import offload as off

    out: dict[str, list[torch.Tensor]] = {"step": [], "exp_avg": [], "exp_avg_sq": []}
    for opt in off._chained(policy.optimizer):
        for st in opt.optimizer.state.values():
            for k in out:
                if k in st:
                    out[k].append(torch.as_tensor(st[k]).detach().clone().float())
    out["main"] = [
        m.detach().clone()
        for opt in off._chained(policy.optimizer)
        for g in opt.shard_fp32_from_float16_groups
        for m in g
    ]
    out["params"] = [p.detach().clone().float() for p in policy.model.parameters()]
    return out


def _run(rank, world, tiny, run_dir, interrupt, plant=False):  # noqa: F811
    from srpo_megatron.trainer.run import checkpoint
    from srpo_megatron.trainer.run.checkpoint import load_checkpoint, save_checkpoint

    shared = []
    real = checkpoint.untie_torch_adam_steps
    checkpoint.untie_torch_adam_steps = lambda opt: shared.append(0 if plant else real(opt))

    policy = tiny_policy(tiny, run_dir, EXTRA)
    for step in range(2):
        tiny_step(policy, rank, step)
    before = _optimizer_state(policy)
    loaded = None
    if interrupt:
        save_checkpoint(policy, run_dir, 2, {"weight_version": 2}, keep_last=2)
        policy = tiny_policy(tiny, run_dir, EXTRA)
        load_checkpoint(policy, Path(run_dir) / "checkpoints" / "step_000002", log=lambda _: None)
        loaded = _optimizer_state(policy)
    tiny_step(policy, rank, 2)
    return before, loaded, _optimizer_state(policy), shared


def test_distributed_optimizer_checkpoint_resumes_exactly(tiny, tmp_path):  # noqa: F811
    straight = run_distributed(_run, 2, tiny, str(tmp_path / "a"), False, timeout=900)
    resumed = run_distributed(_run, 2, tiny, str(tmp_path / "b"), True, timeout=900)
    for rank, ((_, _, a0, _), (b1, loaded, a1, shared)) in enumerate(zip(straight, resumed, strict=True)):
        # megatron shares one step tensor across the loaded states; when it stops, drop the shim.
        assert shared and shared[0] > 0, "megatron no longer shares Adam's step tensor: drop the shim"
        for key in b1:  # what was saved is what is loaded
            bad = [
                i for i, (x, y) in enumerate(zip(b1[key], loaded[key], strict=True)) if not torch.equal(x, y)
            ]
            assert not bad and len(b1[key]) == len(loaded[key]), (
                f"rank {rank}: {key} differs after load {bad}"
            )
        for key in a0:  # and the next step equals the uninterrupted run's
            worst = max((x - y).abs().max().item() for x, y in zip(a0[key], a1[key], strict=True))
            assert worst == 0.0, f"rank {rank}: {key} after the resumed step differs by {worst}"


def test_resume_without_the_step_shim_drifts(tiny, tmp_path):  # noqa: F811
    straight = run_distributed(_run, 2, tiny, str(tmp_path / "a"), False, timeout=900)
    planted = run_distributed(_run, 2, tiny, str(tmp_path / "b"), True, True, timeout=900)
    a, b = straight[0][2]["params"], planted[0][2]["params"]
    drift = max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))
    assert drift > 0, (
        "the shared step tensor must move the resumed step's params (else the shim guards nothing)"
    )
