"""The DP-sharded EMA teacher and the colocated offload, on the real megatron path (CPU, gloo).

- Sharded EMA (``parallel.teacher_fp32: sharded``) at DP 2 is bit-identical to the full EMA teacher fed
  the same optimizer (bf16 and fp32 params), within 1e-6 of a float64 EMA, and holds ~1/DP of its fp32
  bytes; planting a missing all-gather is caught.
- A checkpoint saved at DP 2 resumes exactly at DP 2 (the next step's teacher equals the uninterrupted
  run's) and loads the same fp32 EMA at DP 1, sharded or full.
- Offload round trip (``parallel.offload_during_rollout``): params, optimizer state (main params,
  exp_avg, exp_avg_sq) and teacher are bit-identical after offload -> reload, the next step equals the
  step without the round trip, and the trainer's resident bytes per component equal the planner's
  (train and rollout phase) for the same tiny layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from srpo_megatron.testing.distributed import run_distributed
from tests.helpers.trainer import tiny_policy, tiny_step, write_tiny_policy_run


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_policy_run(tmp_path_factory.mktemp("tiny_offload"))


def _full_master(teacher, policy) -> list[torch.Tensor]:
    """The fp32 EMA copy of every parameter, assembled over DP (sharded) or as held (full)."""
    if hasattr(teacher, "full_masters"):
        return teacher.full_masters()
    return [m.detach().clone() for m in teacher.master or teacher.module.parameters()]


# ---------------------------------------------------------------------------------------------------
def _sharded_vs_full(rank, world, tiny, run_dir, dtype, plant):
    from srpo_megatron.trainer.state.ema_shard import ShardedEmaTeacher, ema_bytes
    from srpo_megatron.trainer.state.teacher import EmaTeacher, fp32_main_params

    if plant:  # the bug the all-gather exists for: each rank updates only its shard of the module
        ShardedEmaTeacher.gather = lambda self: None
    policy = tiny_policy(tiny, run_dir, [f"model.params_dtype={dtype}", "parallel.teacher_fp32=sharded"])
    assert isinstance(policy.teacher, ShardedEmaTeacher)
    module = policy.build_module()
    module.load_state_dict(policy.teacher.module.state_dict())
    reference = EmaTeacher(module.to(policy.device), "ema", 0.3)
    ref64 = [m.double() for m in _full_master(reference, policy)]
    worst_bits, worst64 = 0.0, 0.0
    for step in range(3):
        tiny_step(policy, rank, step)
        main = fp32_main_params(policy.optimizer, policy.model, policy.device)
        reference.update(main)
        ref64 = [(1 - 0.3) * r + 0.3 * m.double() for r, m in zip(ref64, main, strict=True)]
        for a, b in zip(policy.teacher.module.parameters(), reference.module.parameters(), strict=True):
            worst_bits = max(worst_bits, (a.float() - b.float()).abs().max().item())
        for m, r in zip(_full_master(policy.teacher, policy), ref64, strict=True):
            # fp32 rounding of each update, relative to the tensor's scale
            worst64 = max(worst64, ((m.double() - r).abs().max() / r.abs().max()).item())
    moved = max(
        (a.float() - b.float()).abs().max().item()
        for a, b in zip(policy.teacher.module.parameters(), policy.model.parameters(), strict=True)
    )
    return {
        "teacher_vs_full": worst_bits,
        "vs_float64": worst64,
        "sharded_bytes": ema_bytes(policy.teacher),
        "full_bytes": ema_bytes(reference),
        "teacher_vs_policy": moved,
        "numel": sum(p.numel() for p in policy.model.parameters()),
        "low_numel": sum(p.numel() for p in policy.model.parameters() if p.dtype != torch.float32),
    }


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_sharded_ema_equals_full_ema(tiny, tmp_path, dtype):
    out = run_distributed(_sharded_vs_full, 2, tiny, str(tmp_path), dtype, False, timeout=600)
    for r in out:
        assert r["teacher_vs_full"] == 0.0, "the sharded teacher must be bit-identical to the full one"
        assert r["vs_float64"] <= 1e-6, r
        assert r["teacher_vs_policy"] > 0.0, "the teacher must lag the policy (EMA, not a copy)"
    if dtype == "bf16":
        # fp32 params of a bf16 model (the norms on CPU) are their own EMA copy in the sharded teacher
        assert out[0]["full_bytes"] == 4 * out[0]["numel"]
        assert sum(r["sharded_bytes"] for r in out) == 4 * out[0]["low_numel"], "shards partition the copy"
        assert all(r["sharded_bytes"] <= 2 * out[0]["low_numel"] + 4 * 64 for r in out), out  # ~1/DP
    else:
        assert all(r["sharded_bytes"] == 0 for r in out), "fp32: the module is the EMA copy"


def test_missing_all_gather_is_caught(tiny, tmp_path):
    out = run_distributed(_sharded_vs_full, 2, tiny, str(tmp_path), "bf16", True, timeout=600)
    assert any(r["teacher_vs_full"] > 0.0 for r in out)


# ---------------------------------------------------------------------------------------------------
def _save(rank, world, tiny, run_dir):
    from srpo_megatron.trainer.run.checkpoint import save_checkpoint

    policy = tiny_policy(tiny, run_dir, ["model.params_dtype=bf16", "parallel.teacher_fp32=sharded"])
    for step in range(2):
        tiny_step(policy, rank, step)
    saved = [m.clone() for m in _full_master(policy.teacher, policy)]
    teacher = [p.detach().clone() for p in policy.teacher.module.parameters()]
    save_checkpoint(policy, run_dir, 2, {"weight_version": 3}, keep_last=2)
    return saved, teacher


def _resume(rank, world, tiny, run_dir, mode):
    from srpo_megatron.trainer.run.checkpoint import load_checkpoint

    policy = tiny_policy(tiny, run_dir, ["model.params_dtype=bf16", f"parallel.teacher_fp32={mode}"])
    load_checkpoint(policy, Path(run_dir) / "checkpoints" / "step_000002", log=lambda _: None)
    teacher = [p.detach().clone() for p in policy.teacher.module.parameters()]
    return [m.clone() for m in _full_master(policy.teacher, policy)], teacher


def test_sharded_ema_checkpoint_resumes_exactly(tiny, tmp_path):
    """The fp32 EMA saved at DP 2 (sharded) loads bit-exactly at DP 2 and DP 1, sharded or full."""
    run = str(tmp_path / "run")
    saved, teacher = run_distributed(_save, 2, tiny, run, timeout=900)[0]
    for world, mode in ((2, "sharded"), (1, "sharded"), (1, "full")):
        loaded, loaded_teacher = run_distributed(_resume, world, tiny, run, mode, timeout=900)[0]
        assert all(torch.equal(a, b) for a, b in zip(saved, loaded, strict=True)), f"DP{world} {mode}"
        assert all(torch.equal(a, b) for a, b in zip(teacher, loaded_teacher, strict=True))


# ---------------------------------------------------------------------------------------------------
def _roundtrip(rank, world, tiny, run_dir, mode):
    from srpo_megatron.planner.memory import PlanSettings, plan_layout
    from srpo_megatron.planner.model import Layout, ModelShape
    from srpo_megatron.trainer.state import offload as off

    extra = [
        "model.params_dtype=bf16",
        f"parallel.teacher_fp32={mode}",
        "parallel.offload_during_rollout=true",
    ]
    policy = tiny_policy(tiny, run_dir, extra)
    control = tiny_policy(tiny, run_dir, extra)
    for p in (policy, control):
        tiny_step(p, rank, 0)
    o = policy.offload

    def snapshot():
        kept = (off.POLICY, off.OPTIMIZER, off.TEACHER, off.TEACHER_FP32)
        return {c: [t.clone() for t in o.tensors(c)] for c in kept}

    before, train_bytes = snapshot(), o.resident_bytes()
    o.before_rollouts()
    rollout_bytes = o.resident_bytes()
    metrics = o.after_rollouts()
    after = snapshot()
    exact = all(torch.equal(a, b) for c in before for a, b in zip(before[c], after[c], strict=True))
    moments = sum(len(st) for opt in off._chained(policy.optimizer) for st in opt.optimizer.state.values())
    tiny_step(policy, rank, 1)
    tiny_step(control, rank, 1)
    same_step = all(
        torch.equal(a, b)
        for c in (off.POLICY, off.OPTIMIZER, off.TEACHER, off.TEACHER_FP32)
        for a, b in zip(o.tensors(c), control.offload.tensors(c), strict=True)
    )
    # The planner's figures for the same model, layout and DDP buffers.
    shape = ModelShape.from_hf(json.loads((Path(tiny[0]) / "config.json").read_text()))
    ddp = policy.ddp.ddp_config
    settings = PlanSettings(
        layout=Layout(tp=1, pp=1, dp=world),
        gpu_bytes=80 * 1024**3,
        distributed_optimizer=True,
        overlap_grad_reduce=ddp.overlap_grad_reduce,
        teacher_fp32=mode,
        offload_during_rollout=True,
    )
    stage = plan_layout(shape, settings).stage
    return {
        "exact": exact,
        "same_step": same_step,
        "train": train_bytes,
        "rollout": rollout_bytes,
        "metrics": metrics,
        "planned_train": {c: stage.train[c] for c in off.CATEGORIES},
        "planned_rollout": {c: stage.rollout[c] for c in off.CATEGORIES},
        "moments": moments,
        "numel": sum(p.numel() for p in policy.model.parameters()),
        "fp32_numel": sum(p.numel() for p in policy.model.parameters() if p.dtype == torch.float32),
    }


@pytest.mark.parametrize("mode", ["sharded", "full"])
def test_offload_round_trip_is_exact_and_matches_the_planner(tiny, tmp_path, mode):
    from srpo_megatron.trainer.state import offload as off

    for r in run_distributed(_roundtrip, 2, tiny, str(tmp_path), mode, timeout=600):
        assert r["exact"], "params, optimizer state or teacher changed in the offload round trip"
        assert r["same_step"], "a step after the round trip differs from a step without it"
        # The planner counts the GPU layout (every weight bf16, one DDP buffer per dtype). On CPU the
        # local spec's norm weights stay fp32 (their own DDP buffer, padded to lcm(DP, 128) elements),
        # so each component may differ by at most 16 bytes per fp32 weight plus one such padding.
        tol = 16 * (r["fp32_numel"] + 128)
        near = lambda a, b, tol=tol: abs(a - b) <= tol  # noqa: E731
        # Rollout phase: only the policy's weights stay; everything offloaded is exactly 0 in both.
        roll, planned_roll = r["rollout"], r["planned_rollout"]
        for c in (off.GRADS, off.OPTIMIZER, off.TEACHER, off.TEACHER_FP32):
            assert roll[c] == planned_roll[c] == 0, (c, roll[c], planned_roll[c])
        assert near(roll[off.POLICY], planned_roll[off.POLICY]), (roll, planned_roll)
        assert r["metrics"]["memory/rollout_resident_bytes"] == sum(roll.values())
        # Train phase: every component as planned, within the same bound.
        train, planned = r["train"], r["planned_train"]
        for c in off.CATEGORIES:
            assert near(train[c], planned[c]), (c, train[c], planned[c], tol)
            assert train[c] > 0, c
        assert r["moments"] > 0, "the round trip must have carried Adam moments"
