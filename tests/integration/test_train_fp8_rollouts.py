"""FP8 rollouts, audited, end to end in ``srpo train`` (tiny Qwen3, CPU engine, ``rollout.precision``).

The CPU engine emulates SGLang's blockwise-FP8 engine: every weight ``Fp8Layout`` keeps in FP8 is
``dequantize(quantize(W))`` at load and after every sync (``rollout.hf_engine``). The trainer keeps its
own weights, so the precision gap shows where any engine/trainer mismatch shows: the parity metric
(``logprob/gap_*``, ``logprob/topk_kl_*``) and the IS correction's rejections (``loss/is_masked_frac``,
with a tight [is_low, is_high] so the tiny model's gap crosses it). The precision gap itself is
``logprob/precision_gap_*`` (``rollout/precision_audit.py``): the engine scores its samples with the
weights it served and with the weights it was sent, in its own arithmetic. With ``precision: bf16`` (the
same recipe otherwise) the engine serves the sent weights: the precision gap is exactly 0 and the IS
correction masks nothing; the trainer-vs-engine gap stays at float rounding (two programs: the megatron
policy and the HF model). A run stopped after step 2 and resumed reproduces step 3 exactly.
"""

from __future__ import annotations

import pytest

from srpo_megatron.testing.distributed import run_distributed
from tests.helpers.train import read_metrics, train_overrides, train_rank

# tight enough that the emulated FP8 gap (measured on this model: max |Δ log p| ~ 1e-2) crosses them
TIGHT = {"loss.is_low": 0.999, "loss.is_high": 1.001, "rollout.parity_top_k": 4}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from srpo_megatron.testing.tiny import write_tiny_run

    return write_tiny_run(tmp_path_factory.mktemp("tiny_fp8"), num_prompts=8)


def _run(tiny, name: str, **extra) -> list[dict]:
    run_dir = tiny[0] / name
    run_distributed(train_rank, 1, train_overrides(tiny, run_dir, **{**TIGHT, **extra}), timeout=900)
    return read_metrics(run_dir)


@pytest.fixture(scope="module")
def fp8_icepop(tiny):
    return _run(tiny, "fp8_icepop", **{"rollout.precision": "fp8", "loss.is_correction": "icepop"})


def test_fp8_engine_shows_the_precision_gap_every_step(fp8_icepop):
    assert [r["step"] for r in fp8_icepop] == [1, 2, 3]
    for r in fp8_icepop:
        # near-uniform tiny model: its top-4 hold little mass, so the KL is small (measured ~3e-9)
        assert r["logprob/gap_max"] > 1e-3 and r["logprob/topk_kl_max"] > 1e-10, r["step"]
        assert r["logprob/precision_gap_max"] > 1e-3 and r["logprob/precision_gap_mean"] > 0, r["step"]
        assert r["loss/is_masked_frac"] > 0, r["step"]


def test_bf16_engine_shows_none(tiny, fp8_icepop):
    rows = _run(tiny, "bf16_icepop", **{"rollout.precision": "bf16", "loss.is_correction": "icepop"})
    for bf16, fp8 in zip(rows, fp8_icepop, strict=True):
        # the served precision's own gap: exactly 0 (served weights == sent weights, same arithmetic)
        assert bf16["logprob/precision_gap_max"] == 0.0 and bf16["logprob/precision_gap_mean"] == 0.0
        assert bf16["loss/is_masked_frac"] == 0.0
        assert bf16["logprob/gap_max"] < 1e-4 < fp8["logprob/gap_max"]
        assert bf16["logprob/topk_kl_max"] < 1e-3 * fp8["logprob/topk_kl_max"]


def test_mis_rejects_the_gap_too(tiny):
    rows = _run(
        tiny, "fp8_mis", **{"rollout.precision": "fp8", "loss.is_correction": "mis", "train.steps": 1}
    )
    assert rows[0]["loss/is_masked_frac"] > 0 and rows[0]["logprob/gap_max"] > 1e-4
    assert rows[0]["logprob/precision_gap_max"] > 1e-3


def test_resume_after_step_2_is_bit_identical(tiny, fp8_icepop):
    """Stopped after step 2 (its checkpoint), resumed to 3: step 3's metrics equal the uninterrupted run's
    exactly (the emulated FP8 engine is rebuilt from the checkpoint's weights, deterministically)."""
    fp8 = {"rollout.precision": "fp8", "loss.is_correction": "icepop"}
    _run(tiny, "fp8_resumed", **fp8, **{"train.steps": 2})
    rows = _run(tiny, "fp8_resumed", **fp8, **{"train.steps": 3})
    got = {r["step"]: r for r in rows}[3]
    want = fp8_icepop[2]
    keys = ("loss/total", "grad_norm", "reward/mean", "logprob/gap_max", "logprob/gap_mean")
    for key in (*keys, "logprob/precision_gap_max", "logprob/precision_gap_mean"):
        assert got[key] == want[key], key
    assert got["loss/is_masked_frac"] == want["loss/is_masked_frac"]
