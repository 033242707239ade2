"""Expert parallelism with data-dependent passes: every DP rank runs the same number of forwards
(``trainer/microbatches/lockstep.py``), and the fillers that make it so change nothing.

World 2 with an MoE policy: EP2 (the two DP ranks split the experts) against EP1 (each DP rank holds every
expert: no forward collective across DP) on the same per-rank samples. DP rank 0 has the SDPO samples of
the packed == padded test (half need a teacher); DP rank 1 has only GRPO samples, shorter ones, so it runs
no teacher pass of its own and, when packed, fewer micro-batches. Without lockstep the EP2 run hangs in
the MoE dispatcher's all-gather (what the EP2 ``srpo train`` test did: DP rank 0 in the teacher pass, DP
rank 1 in the training pass) and this test fails on its timeout. Checked at EP2 against EP1 (≤ 1e-5):
π_old on both ranks, the teacher's log-probs on rank 0, the step's loss and token counts, the grad norm,
and every parameter after the optimizer step (the fillers add no loss, gradient or token).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from srpo_megatron.testing.distributed import run_distributed
from tests.helpers.trainer import packing_samples

pytestmark = pytest.mark.moe

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "examples" / "tiny_cpu_test.yaml"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from srpo_megatron.testing.tiny import write_tiny_run

    return write_tiny_run(tmp_path_factory.mktemp("tiny_lockstep"), num_prompts=8, moe=True)


def _grpo_samples():
    from srpo_megatron.trainer.step_types import Sample

    g = torch.Generator().manual_seed(11)
    out = []
    for m in range(8):
        prompt = torch.randint(10, 2000, (3,), generator=g).tolist()
        resp = torch.randint(10, 2000, (2 + m % 2,), generator=g).tolist()
        logp = (-torch.rand(len(resp), generator=g) * 3).tolist()
        adv = 0.5 if m % 2 else -0.5
        out.append(Sample(m // 4, m % 4, prompt, resp, logp, reward=float(adv > 0), advantage=adv))
    return out


def _step(rank, world, tiny, run_dir, ep, budget):
    from srpo_megatron.config import load_config
    from srpo_megatron.parallel import initialize_model_parallel
    from srpo_megatron.trainer.microbatches import lockstep as lockstep_module
    from srpo_megatron.config import TrainConfig
    from srpo_megatron.trainer.passes.learning import learn
    from srpo_megatron.trainer.state.policy import Policy
    from srpo_megatron.trainer.passes.scoring import scoring_pass
    from srpo_megatron.weights.export import iter_stage_hf_tensors

    _, hf, data = tiny
    groups = initialize_model_parallel(1, 1, seed=1, ep=ep)
    ov = [
        f"model.hf_dir={hf}",
        f"data.train_files=[{data}]",
        f"run.dir={run_dir}",
        f"parallel.ep={ep}",
        "loss.mode=srpo",
        "optim.lr=0.01",
        "optim.warmup_steps=0",
        "train.micro_batch_size=2",
        f"train.max_tokens_per_micro_batch={budget}",
    ]
    policy = Policy(load_config(TrainConfig, str(RECIPE), ov), groups)
    fillers = []
    real = lockstep_module.filler_micro_batch
    lockstep_module.filler_micro_batch = lambda *a, **k: fillers.append(1) or real(*a, **k)
    samples = packing_samples() if groups.dp_rank == 0 else _grpo_samples()
    scored = scoring_pass(policy, samples)
    t = scored.tokens
    kept = {"π_old": t.old_logp.clone(), "teacher log-probs": t.teacher_logp.clone()}
    stats = learn(policy, scored, 1)
    params = {
        k: v.detach().float().clone() for k, v in iter_stage_hf_tensors(policy.model, policy.table, groups)
    }
    return {"kept": kept, "stats": stats, "params": params, "fillers": len(fillers)}


def _run(tiny, tmp_path, ep, budget):
    return run_distributed(_step, 2, tiny, str(tmp_path / f"ep{ep}_{budget}"), ep, budget, timeout=600)


@pytest.mark.parametrize("budget", [0, 24], ids=["padded", "packed"])
def test_ep2_with_uneven_passes_completes_and_equals_ep1(tiny, tmp_path, budget):
    ref, got = _run(tiny, tmp_path, 1, budget), _run(tiny, tmp_path, 2, budget)
    assert all(r["fillers"] == 0 for r in ref), "EP1 needs no fillers"
    assert got[1]["fillers"] > 0, "DP rank 1 (no teacher samples) ran no filler: the test lost its point"
    assert ref[0]["stats"].sdpo_loss_sum != 0.0, "no SDPO loss on rank 0: the teacher path is not covered"
    for r, w in zip(ref, got, strict=True):
        for name, want in r["kept"].items():
            assert torch.allclose(w["kept"][name], want, atol=1e-5, rtol=0), name
        for k in ("loss", "tokens", "sdpo_loss_sum", "grpo_loss_sum"):
            assert abs(getattr(w["stats"], k) - getattr(r["stats"], k)) <= 1e-5, k
        assert abs(w["stats"].grad_norm_sum - r["stats"].grad_norm_sum) <= 1e-5 * r["stats"].grad_norm_sum
    params = {**got[0]["params"], **got[1]["params"]}
    ref_params = {**ref[0]["params"], **ref[1]["params"]}
    assert sorted(params) == sorted(ref_params)
    worst = max((params[k] - v).abs().max().item() for k, v in ref_params.items())
    assert worst <= 1e-5, f"parameters after the step differ by {worst}"
