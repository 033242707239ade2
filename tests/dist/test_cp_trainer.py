"""Context parallelism in the trainer: a full SRPO step (scoring pass, teacher scoring, training pass,
optimizer step) at CP2, TP2×CP2 and CP2×PP2 equals the same step at TP1, all with packing on.

Checked (≤ 1e-5): π_old, the teacher's top-K + tail log-probs and entropies on every CP rank (each rank
scores only its chunks, so these prove the CP gather, including the teacher's rows that another CP rank
scored than the student's), the step's loss, per-branch sums and token counts summed over all ranks as
``gather_stats`` does (counted once per CP group), the grad norm, and every parameter after the step,
exported through the weight-sync path (``iter_stage_hf_tensors``), which must send each tensor exactly
once (CP ranks hold identical weights). The samples are those of the packed == padded test: different
prompt and response lengths, half take the SDPO branch with a teacher prompt longer than the student's.

The teacher entropy (≈ 12 nats over the real Qwen vocabulary, summed over the TP vocabulary shards in fp32)
is compared relatively: TP2×CP1 already differs from TP1 by 3.1e-5 absolute (2.6e-6 relative), the same
figure as TP2×CP2, so that part is TP reduction order, not CP.

Planted bugs at CP2, each caught: the global token normalisers counted once per CP rank, the teacher's
scored rows not gathered over the CP group, and an export that ignores CP (both CP ranks send).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from srpo_megatron.testing.distributed import run_distributed
from tests.helpers.trainer import packing_samples

pytestmark = pytest.mark.packing

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "examples" / "tiny_cpu_test.yaml"
BUDGET = 32  # a multiple of 2·CP; about three sequences per micro-batch
PLANTS = {  # planted bug -> the check that must see it
    "tokens_per_cp_rank": "grad norm",  # the loss (≈ 0 here: advantages ±0.5 cancel) halves, so do the grads
    "no_teacher_gather": "teacher log-probs",
    "export_every_cp_rank": "export",
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from srpo_megatron.testing.tiny import write_tiny_run

    return write_tiny_run(tmp_path_factory.mktemp("tiny_cp"), num_prompts=8)


def _samples():
    """The packed == padded test's samples plus one SDPO sample whose teacher sequence (26-token teacher
    prompt, 1 response token) fills a micro-batch alone: one CP rank holds none of its response rows."""
    from srpo_megatron.trainer.step_types import Sample

    extra = Sample(
        2,
        0,
        [11, 12, 13, 14],
        [15],
        [-1.0],
        reward=0.0,
        advantage=-0.5,
        grpo=False,
        sdpo=True,
        needs_teacher=True,
        teacher_prompt_ids=list(range(100, 126)),
    )
    return [*packing_samples(), extra]


def _plant(name: str | None) -> None:
    """Monkeypatch one bug into the trainer's CP path (in this worker process only)."""
    from megatron.core import parallel_state as ps

    from srpo_megatron.trainer.microbatches import context_parallel
    from srpo_megatron.trainer.passes import learning

    if name == "tokens_per_cp_rank":  # normalisers reduced over DP×CP: every token counted once per CP rank
        real = learning.global_normalizers
        learning.global_normalizers = lambda batches, beta, group: real(
            batches, beta, ps.get_data_parallel_group(with_context_parallel=True)
        )
    elif name == "no_teacher_gather":
        real = context_parallel.gather_rows
        context_parallel.gather_rows = lambda tokens, fields, group: (
            None if fields == context_parallel.TEACHER_FIELDS else real(tokens, fields, group)
        )


def _step(rank, world, tiny, run_dir, tp, pp, cp, plants, extra=()):
    from dataclasses import replace

    from srpo_megatron.config import load_config
    from srpo_megatron.parallel import initialize_model_parallel
    from srpo_megatron.trainer.microbatches import context_parallel
    from srpo_megatron.trainer.passes import learning
    from srpo_megatron.config import TrainConfig
    from srpo_megatron.trainer.passes.learning import learn
    from srpo_megatron.trainer.state.policy import Policy
    from srpo_megatron.trainer.passes.scoring import scoring_pass
    from srpo_megatron.weights.export import iter_stage_hf_tensors

    _, hf, data = tiny
    groups = initialize_model_parallel(tp, pp, seed=1, cp=cp)
    out = {}
    originals = (learning.global_normalizers, context_parallel.gather_rows)
    for plant in (None, *plants):
        _plant(plant)
        try:
            ov = [
                f"model.hf_dir={hf}",
                f"data.train_files=[{data}]",
                f"run.dir={run_dir}/{plant}",
                f"parallel.tp={tp}",
                f"parallel.pp={pp}",
                f"parallel.cp={cp}",
                "loss.mode=srpo",
                "optim.lr=0.01",
                "optim.warmup_steps=0",
                f"train.max_tokens_per_micro_batch={BUDGET}",
                *extra,
            ]
            policy = Policy(load_config(TrainConfig, str(RECIPE), ov), groups)
            scored = scoring_pass(policy, _samples())
            t = scored.tokens
            kept = (
                None
                if t is None
                else {
                    "π_old": t.old_logp.clone(),
                    "top-K ids": t.topk_ids.clone(),
                    "teacher log-probs": t.teacher_logp.clone(),
                    "teacher entropy": t.teacher_entropy.clone(),
                }
            )
            stats = learn(policy, scored, 1)
            # the planted export ignores CP (every CP rank believes it is CP rank 0, as before CP was wired)
            export_groups = replace(groups, cp_rank=0) if plant == "export_every_cp_rank" else groups
            params = dict(iter_stage_hf_tensors(policy.model, policy.table, export_groups))
        finally:
            learning.global_normalizers, context_parallel.gather_rows = originals
        out[plant] = {
            "kept": kept,
            "stats": stats,
            "teacher_runs": scored.stats.teacher_runs,
            "params": {k: v.detach().float().clone() for k, v in params.items()},
        }
    return out


def _run(tiny, tmp_path, tp, pp, cp, plants=(), extra=()):
    world = tp * pp * cp
    return run_distributed(_step, world, tiny, str(tmp_path), tp, pp, cp, plants, extra, timeout=900)


def _combined(results, plant):
    """What the step logged (sums over ranks, as ``gather_stats``) and every exported tensor (each once)."""
    sums = {"loss": 0.0, "tokens": 0.0, "sdpo_loss_sum": 0.0, "grpo_loss_sum": 0.0, "teacher_runs": 0.0}
    params: dict[str, torch.Tensor] = {}
    for r in results:
        s = r[plant]["stats"]
        for k in sums:
            sums[k] += r[plant]["teacher_runs"] if k == "teacher_runs" else getattr(s, k)
        twice = sorted(set(params) & set(r[plant]["params"]))
        assert not twice, f"{plant}: tensors {twice[:3]} exported by two ranks (a CP replica sent weights)"
        params.update(r[plant]["params"])
    grad_norm = max(r[plant]["stats"].grad_norm_sum for r in results)
    return sums, grad_norm, params


@pytest.fixture(scope="module")
def reference(tiny, tmp_path_factory):
    results = _run(tiny, tmp_path_factory.mktemp("cp_ref"), 1, 1, 1)
    return results[0][None]["kept"], *_combined(results, None)


def _differences(results, plant, reference) -> dict[str, float]:
    ref_kept, ref_sums, ref_norm, ref_params = reference
    out = {}
    for r in results:  # every last-stage rank, every CP rank, must hold every row
        kept = r[plant]["kept"]
        if kept is None:
            continue
        for name, want in ref_kept.items():
            diff = (kept[name] - want).abs()
            if name == "teacher entropy":  # ≈ 12 nats: relative (see the module docstring)
                diff = diff / want.abs().clamp_min(1.0)
            out[name] = max(out.get(name, 0.0), diff.max().item())
    sums, norm, params = _combined(results, plant)
    for k, want in ref_sums.items():
        out[k] = abs(sums[k] - want)
    out["grad norm"] = abs(norm - ref_norm) / ref_norm
    assert sorted(params) == sorted(ref_params), f"{plant}: exported tensor names differ"
    out["parameters"] = max((params[k] - want).abs().max().item() for k, want in ref_params.items())
    return out


@pytest.mark.parametrize("tp,pp,cp", [(1, 1, 2), (2, 1, 2), (1, 2, 2)])
def test_context_parallel_step_equals_tp1(tiny, tmp_path, reference, tp, pp, cp):
    assert reference[1]["sdpo_loss_sum"] != 0.0, "no SDPO loss: the test would not see the teacher path"
    plants = tuple(PLANTS) if (tp, pp) == (1, 1) else ()
    results = _run(tiny, tmp_path, tp, pp, cp, plants)
    diffs = _differences(results, None, reference)
    bad = {k: v for k, v in diffs.items() if v > 1e-5}
    assert not bad, f"TP{tp}×PP{pp}×CP{cp} differs from TP1: {bad}"
    for plant, check in PLANTS.items():
        if plant not in plants:
            continue
        try:
            caught = {k: v for k, v in _differences(results, plant, reference).items() if v > 1e-5}
        except AssertionError as e:
            caught = {"export": str(e)} if "exported by two ranks" in str(e) else {}
        assert check in caught, f"planted bug {plant!r}: the {check} check did not see it (caught {caught})"


def test_context_parallel_seq_mean_token_mean_equals_tp1(tiny, tmp_path):
    """``loss.aggregation: seq_mean_token_mean`` at CP2: each CP rank trains on half of a sample's rows, yet
    every row keeps its sample's full 1/|y_i| and N_seq is counted once per DP replica (the planted N_seq
    over DP×CP doubles the denominator: the grad norm sees it)."""
    extra = ("loss.aggregation=seq_mean_token_mean",)
    ref = _run(tiny, tmp_path / "tp1", 1, 1, 1, extra=extra)
    reference = (ref[0][None]["kept"], *_combined(ref, None))
    assert reference[1]["sdpo_loss_sum"] != 0.0, "no SDPO loss: the test would not see the teacher path"
    results = _run(tiny, tmp_path / "cp2", 1, 1, 2, ("tokens_per_cp_rank",), extra)
    bad = {k: v for k, v in _differences(results, None, reference).items() if v > 1e-5}
    assert not bad, f"CP2 differs from TP1 under seq_mean_token_mean: {bad}"
    caught = {k: v for k, v in _differences(results, "tokens_per_cp_rank", reference).items() if v > 1e-5}
    assert "grad norm" in caught, f"planted N_seq over DP×CP not seen (caught {caught})"
