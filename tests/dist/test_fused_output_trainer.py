"""A full SRPO step (scoring pass, teacher scoring, training pass, optimizer step) with
``performance.fused_output: on`` equals ``off`` (megatron's output layer and materialised logits), on the
real megatron path: π_old, the student's top-K ids, the teacher's top-K + tail log-probs and entropies, the
loss, the grad norm and every parameter after the step.

Layouts: the tiny Qwen3 padded and packed (token-budget micro-batches) at TP1, at TP2 (the vocabulary shards
and their padding differ per rank), with the trust-region teacher (the fused logits mix), and the tiny
Qwen3-MoE. Half the samples take the SDPO branch.
"""

from __future__ import annotations

import pytest

from srpo_megatron.testing.distributed import run_distributed
from tests.helpers.losses_reference import rel_err
from tests.helpers.recipe import RECIPE
from tests.helpers.trainer import packing_samples

CASES = {  # name: (model, tp, extra overrides)
    "qwen3-tp1": ("qwen3", 1, ()),
    "qwen3-packed": ("qwen3", 1, ("train.max_tokens_per_micro_batch=24",)),
    "qwen3-tp2": ("qwen3", 2, ()),
    "qwen3-trust-region": ("qwen3", 1, ("teacher.kind=trust_region",)),
    "qwen3-moe": ("moe", 1, ()),
}


@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory):
    from srpo_megatron.testing.tiny import write_tiny_run

    root = tmp_path_factory.mktemp("tiny_fused")
    return {
        "qwen3": write_tiny_run(root / "dense", num_prompts=8),
        "moe": write_tiny_run(root / "moe", num_prompts=8, moe=True),
    }


def _step(rank, world, tiny, run_dir, tp, extra):
    import torch

    from srpo_megatron.config import TrainConfig, load_config
    from srpo_megatron.parallel import initialize_model_parallel
    from srpo_megatron.trainer.passes.learning import learn
    from srpo_megatron.trainer.state.policy import Policy
    from srpo_megatron.trainer.passes.scoring import scoring_pass

    _, hf, data = tiny
    groups = initialize_model_parallel(tp, 1, seed=1)
    out = {}
    for fused in ("off", "on"):
        ov = [
            f"model.hf_dir={hf}",
            f"data.train_files=[{data}]",
            f"run.dir={run_dir}/{fused}",
            f"parallel.tp={tp}",
            f"performance.fused_output={fused}",
            "loss.mode=srpo",
            "optim.lr=0.01",
            "optim.warmup_steps=0",
            "optim.clip_grad=1.0",
            "model.params_dtype=fp32",  # on a GPU too (tools/gpu_smoke_checks.py): the bound is fp32's
            "train.micro_batch_size=3",
            *extra,
        ]
        policy = Policy(load_config(TrainConfig, str(RECIPE), ov), groups)
        assert policy.head.fused is (fused == "on")
        scored = scoring_pass(policy, packing_samples())
        t = scored.tokens
        kept = (t.old_logp, t.topk_ids, t.teacher_logp, t.teacher_entropy)
        stats = learn(policy, scored, 1)
        params = {n: p.detach().float().clone() for n, p in policy.model.named_parameters()}
        out[fused] = (tuple(x.clone() for x in kept), stats.loss, stats.grad_norm_sum, params)
        del policy
        torch.manual_seed(0)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_srpo_step_with_the_fused_output_layer_equals_megatrons_output_layer(tiny_runs, tmp_path, case):
    import torch

    model, tp, extra = CASES[case]
    results = run_distributed(_step, tp, tiny_runs[model], str(tmp_path), tp, extra, timeout=900)
    for rank, res in enumerate(results):
        (ref_kept, ref_loss, ref_norm, ref_params), (kept, loss, norm, params) = res["off"], res["on"]
        assert float((ref_kept[2] != 0).sum()) > 0, "no teacher rows: the test would not see the teacher path"
        for name, got, want in zip(
            ("π_old", "top-K ids", "teacher log-probs", "teacher entropy"), kept, ref_kept, strict=True
        ):
            if name == "top-K ids":
                assert torch.equal(got, want), f"{case} rank {rank}: {name} differ"
                continue
            finite = torch.isfinite(want)
            assert torch.equal(finite, torch.isfinite(got)), f"{case} rank {rank}: {name} finiteness"
            diff = rel_err(got[finite], want[finite])
            assert diff <= 1e-6, f"{case} rank {rank}: {name} differs by {diff} (relative)"
        assert loss == pytest.approx(ref_loss, abs=1e-6), f"{case} rank {rank}: loss"
        assert norm == pytest.approx(ref_norm, rel=1e-5), f"{case} rank {rank}: grad norm"
        for name, want in ref_params.items():
            diff = (params[name] - want).abs().max().item()
            assert diff <= 1e-6, f"{case} rank {rank}: parameter {name} differs by {diff} after the step"
