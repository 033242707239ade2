"""The CPU engine's precision audit (``rollout/precision_audit.py``): |log π_served − log π_sent| per token.

bf16 serves the sent weights, so the gap is exactly 0; fp8 serves dequantize(quantize(W)), so it is not,
and it equals the gap between two separately built models (one holding the sent weights, one their
fake-quantized copy) scored by a plain forward. A bf16 engine that quantizes anyway (planted) shows it.
"""

from __future__ import annotations

import copy

import torch

from srpo_megatron.ops.fp8_blocks import fake_quantize
from srpo_megatron.rollout.base import SamplingParams
from srpo_megatron.rollout.hf_engine import HFEngine
from srpo_megatron.testing.tiny import tiny_hf_model

PARAMS = SamplingParams(n=2, temperature=0.8, max_new_tokens=6, seed=3)
PROMPTS = [[1, 5, 9, 4], [7, 3]]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = tiny_hf_model("qwen3", num_layers=2)
    with torch.no_grad():  # weights large enough that FP8 rounding moves the log-probs visibly
        for p in model.parameters():
            p.mul_(8.0)
    return model


def _gaps(engine: HFEngine) -> list[float]:
    done = [c for group in engine.generate(PROMPTS, PARAMS) for c in group]
    assert all(c.precision_gap is not None and len(c.precision_gap) == len(c.token_ids) for c in done)
    return [g for c in done for g in c.precision_gap]


def _logp(model: torch.nn.Module, prompt: list[int], response: list[int]) -> torch.Tensor:
    """Independent scoring: a plain forward of a separate model, float64 log-softmax."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].double()
    return torch.log_softmax(logits / PARAMS.temperature, -1).gather(-1, ids[0, len(prompt) :, None])[:, 0]


def test_bf16_engine_shows_exactly_zero_before_and_after_a_sync():
    model = _model()
    engine = HFEngine(copy.deepcopy(model), precision="bf16", precision_audit=True)
    assert set(_gaps(engine)) == {0.0}
    moved = {n: t * 1.01 for n, t in model.state_dict().items()}
    engine.update_weights(list(moved.items()), 1)
    assert set(_gaps(engine)) == {0.0}


def test_fp8_engine_gap_is_the_served_precisions_own():
    model = _model()
    sent = {n: t.clone() for n, t in model.state_dict().items()}
    engine = HFEngine(copy.deepcopy(model), precision="fp8", precision_audit=True)
    plain = HFEngine(copy.deepcopy(model), precision="fp8")  # same engine without the audit
    done = [c for group in engine.generate(PROMPTS, PARAMS) for c in group]
    want = [c for group in plain.generate(PROMPTS, PARAMS) for c in group]
    # the audit's weight swap leaves the served weights as they were: same samples as without it
    assert [c.token_ids for c in done] == [c.token_ids for c in want]
    assert [c.logprobs for c in done] == [c.logprobs for c in want]
    served = copy.deepcopy(model)
    served.load_state_dict({n: fake_quantize(t) if n in engine._audit._sent else t for n, t in sent.items()})
    gaps = []
    for c in done:
        prompt = PROMPTS[c.prompt_index]
        ref = (_logp(served, prompt, c.token_ids) - _logp(model, prompt, c.token_ids)).abs()
        torch.testing.assert_close(
            torch.tensor(c.precision_gap, dtype=torch.float64), ref, atol=1e-6, rtol=1e-5
        )
        gaps += c.precision_gap
    assert max(gaps) > 1e-4


def test_a_bf16_engine_that_quantizes_anyway_shows_a_gap(monkeypatch):
    """Planted: the bf16 engine applies the FP8 emulation anyway. The audit, which compares the served
    weights with the as-sent ones rather than trusting the configured precision, reports it."""
    from srpo_megatron.conversion.fp8_layout import Fp8Layout

    real = HFEngine._emulate_fp8

    def quantizing_anyway(self, names):
        self._fp8 = Fp8Layout()
        real(self, names)

    monkeypatch.setattr(HFEngine, "_emulate_fp8", quantizing_anyway)
    engine = HFEngine(_model(), precision="bf16", precision_audit=True)
    assert max(_gaps(engine)) > 1e-4


def test_engines_without_the_audit_report_none():
    engine = HFEngine(_model(), precision="fp8")
    assert all(c.precision_gap is None for group in engine.generate(PROMPTS, PARAMS) for c in group)
