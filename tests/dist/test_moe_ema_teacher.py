"""The fp32 EMA teacher of an MoE policy under expert parallelism and the distributed optimizer.

Megatron's distributed optimizer cuts each grad buffer over that buffer's data-parallel group: dense
parameters over dense DP, experts over *expert* DP (``get_megatron_optimizer`` builds the chained
optimizer's expert half over ``intra_expt_dp_group``). The teacher's fp32 copy
(``parallel.teacher_fp32: full``, trainer/state/teacher.py) all-reduces each group's disjoint shards. At EP2 on
two ranks dense DP is 2 and expert DP is 1, so reducing the experts over the dense group (the bug, planted
here) sums rank 0's experts with rank 1's.

Each rank drives three real trainer steps (``learn`` + ``Policy.update_teacher``) and, after each, gathers
the policy's fp32 main params by megatron's own code, ``DistributedOptimizer.get_parameter_state_dp_zero``
(each optimizer's gloo group, its own bucket layout), and accumulates a float64 EMA from them, starting
from the policy's own initial weights. The teacher's fp32 copy must equal it within 1e-6 (bf16 params,
the MoE recipes' dtype: the bf16 weights' fp32 copies and the fp32 norms' own shards both count), and the
teacher must lag the policy.

At TP2×EP2 on four ranks (expert TP 1) the dense and the expert DP groups hold the same ranks ({0, 2},
{1, 3}), so the planted bug happens to give the right answer there (seen); it is planted at EP2 on two
ranks and at DP4×EP2 on four (dense DP 4, expert DP 2: the groups differ in size, and the shards too).
``teacher_fp32: sharded`` (trainer/state/ema_shard.py) is held to the same reference and plant at EP2.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from srpo_megatron.testing.distributed import run_distributed

pytestmark = pytest.mark.moe

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "examples" / "tiny_cpu_test.yaml"
ALPHA, STEPS = 0.3, 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from srpo_megatron.testing.tiny import write_tiny_run

    return write_tiny_run(tmp_path_factory.mktemp("tiny_moe_ema"), num_prompts=4, moe=True)


def _samples(dp_rank: int, step: int):
    from srpo_megatron.trainer.step_types import Sample

    g = torch.Generator().manual_seed(100 * step + dp_rank)
    out = []
    for m in range(4):
        prompt = torch.randint(10, 2000, (4,), generator=g).tolist()
        resp = torch.randint(10, 2000, (4,), generator=g).tolist()
        out.append(Sample(0, m, prompt, resp, [-2.0] * 4, advantage=1.0 if m % 2 else -1.0))
    return out


def megatron_main_params(optimizer, model) -> list[torch.Tensor]:
    """Every parameter's fp32 main copy (module order), gathered by megatron's own
    ``get_parameter_state_dp_zero`` over each DistributedOptimizer's gloo DP group: per grad buffer, its
    buckets concatenated without the padding after each bucket."""
    full: dict[torch.nn.Parameter, torch.Tensor] = {}
    for opt in optimizer.chained_optimizers:
        state = opt.get_parameter_state_dp_zero(return_on_all_ranks=True)
        for index, buffer in enumerate(opt.buffers):
            (per_dtype,) = state[index].values()
            world, offset = per_dtype["param"], 0
            for bucket in buffer.buckets:
                for p in bucket.params:
                    start, end, _ = buffer.param_index_map[p]
                    begin = start - bucket.offset + offset
                    full[p] = world[begin : begin + (end - start)].view(p.shape)
                offset += bucket.numel_unpadded
    return [full[p] if p in full else p.detach().float() for p in model.parameters()]


def _run(rank, world, tiny, run_dir, tp, ep, mode, plant):
    from megatron.core import parallel_state as ps

    from srpo_megatron.config import load_config
    from srpo_megatron.parallel import initialize_model_parallel
    from srpo_megatron.trainer.state import teacher as teacher_module
    from srpo_megatron.config import TrainConfig
    from srpo_megatron.trainer.passes.learning import learn
    from srpo_megatron.trainer.state.policy import Policy
    from srpo_megatron.trainer.passes.scoring import scoring_pass

    if plant:  # the old choice: every shard reduced over the dense DP group, experts included
        teacher_module.buffer_group = lambda buffer: ps.get_data_parallel_group(with_context_parallel=True)
    _, hf, data = tiny
    groups = initialize_model_parallel(tp, 1, seed=1, ep=ep)
    ov = [
        f"model.hf_dir={hf}",
        f"data.train_files=[{data}]",
        f"run.dir={run_dir}",
        f"parallel.tp={tp}",
        f"parallel.ep={ep}",
        "parallel.distributed_optimizer=true",
        f"parallel.teacher_fp32={mode}",
        "model.params_dtype=bf16",
        "loss.mode=srpo",
        "optim.lr=0.02",
        "optim.clip_grad=0.0",
        f"teacher.ema_alpha={ALPHA}",
    ]
    policy = Policy(load_config(TrainConfig, str(RECIPE), ov), groups)
    assert len(policy.optimizer.chained_optimizers) == 2, "a dense and an expert distributed optimizer"
    # before the first step the main params are the (bf16 or fp32) model params, exactly
    ref = [p.detach().double() for p in policy.model.parameters()]
    for step in range(STEPS):
        learn(policy, scoring_pass(policy, _samples(groups.dp_rank, step)), 1)
        policy.update_teacher()
        main = megatron_main_params(policy.optimizer, policy.model)
        ref = [(1 - ALPHA) * r + ALPHA * m.double() for r, m in zip(ref, main, strict=True)]
    # the teacher's fp32 copy: whole on every rank (full), or assembled from the ranks' slices (sharded)
    master = policy.teacher.master if mode == "full" else policy.teacher.full_masters()
    names = [n for n, _ in policy.model.named_parameters()]
    err = {n: (m.double() - r).abs().max().item() for n, m, r in zip(names, master, ref, strict=True)}
    lag = max((m.double() - p.double()).abs().max().item() for m, p in zip(master, main, strict=True))
    return {"err": err, "lag": lag, "dtypes": sorted({str(p.dtype) for p in policy.model.parameters()})}


def _worst(out, experts: bool) -> float:
    return max(e for r in out for n, e in r["err"].items() if ("experts" in n) == experts)


# name: (world, tp, ep) -> dense DP, expert DP: ep2 2, 1; tp2_ep2 2, 2 (same ranks); dp4_ep2 4, 2
LAYOUTS = {"ep2": (2, 1, 2), "tp2_ep2": (4, 2, 2), "dp4_ep2": (4, 1, 2)}
CASES = [("ep2", "full"), ("tp2_ep2", "full"), ("dp4_ep2", "full"), ("ep2", "sharded")]


@pytest.mark.parametrize(("layout", "mode"), CASES, ids=[f"{lay}-{mode}" for lay, mode in CASES])
def test_fp32_teacher_is_the_float64_ema_of_megatron_main_params(tiny, tmp_path, layout, mode):
    world, tp, ep = LAYOUTS[layout]
    out = run_distributed(_run, world, tiny, str(tmp_path), tp, ep, mode, False, timeout=1200)
    assert out[0]["dtypes"] == ["torch.bfloat16", "torch.float32"], "bf16 weights and fp32 norms"
    assert _worst(out, experts=True) <= 1e-6, [r["err"] for r in out]
    assert _worst(out, experts=False) <= 1e-6, [r["err"] for r in out]
    assert all(r["lag"] > 1e-4 for r in out), "the teacher must lag the policy (EMA, not a copy)"


PLANTED = [("ep2", "full"), ("dp4_ep2", "full"), ("ep2", "sharded")]


@pytest.mark.parametrize(("layout", "mode"), PLANTED, ids=[f"{lay}-{mode}" for lay, mode in PLANTED])
def test_experts_reduced_over_the_dense_dp_group_are_caught(tiny, tmp_path, layout, mode):
    world, tp, ep = LAYOUTS[layout]
    out = run_distributed(_run, world, tiny, str(tmp_path), tp, ep, mode, True, timeout=1200)
    assert _worst(out, experts=True) > 1e-3, "the planted group choice must mix the ranks' experts"
    assert _worst(out, experts=False) <= 1e-6, "dense parameters are sharded over dense DP: unaffected"
