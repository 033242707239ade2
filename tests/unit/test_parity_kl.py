"""The trainer-vs-engine parity KL over the engine's top-K (``losses/parity.py``,
``trainer/passes/parity.py``) and
the engines' top-K return path (SGLang's ``top_logprobs_num`` request field and ``output_top_logprobs``).

- The KL is exactly 0 for identical distributions, equals an independent float64 computation (plain Python
  ``math``), rises with the size of a perturbation, is a lower bound on the full-vocabulary KL, and, unlike
  a KL renormalised over the K ids, sees mass moved into or out of the tail.
- Misaligned rows (the engine's top-K of position t+1 compared at position t) read far from 0.
- The SGLang request carries ``top_logprobs_num`` (SGLang's own ``GenerateReqInput`` accepts it:
  ``test_sglang_contract.py``, sglang tier) and the response's ``output_top_logprobs`` parse into
  ``[R, K]`` tensors; malformed ones raise.
- Partial rollouts keep the segments' top-K rows end to end; ``engine_top_k`` refuses a sample whose
  top-K rows do not match its tokens; the step metrics appear only when the engine sent top-K.
"""

from __future__ import annotations

import math

import pytest
import torch

from srpo_megatron.losses.parity import topk_parity_kl
from srpo_megatron.rollout.base import Completion, EngineError, SamplingParams
from srpo_megatron.rollout.partial import merge_segments
from srpo_megatron.rollout.sglang.protocol import (
    build_generate_request,
    build_requests_body,
    parse_generate_response,
)
from srpo_megatron.testing.sglang_standin import sglang_output
from srpo_megatron.trainer.observe.step_metrics import step_metrics
from srpo_megatron.trainer.passes.parity import engine_top_k, parity_stats
from srpo_megatron.trainer.step_types import RolloutBatch, Sample, StepStats
from tests.helpers.parity import reference_kl as _reference_kl


def _distributions(t: int = 12, v: int = 40, k: int = 5, noise: float = 0.0, seed: int = 0):
    """Engine and trainer full log-softmaxes [T, V] (the trainer's logits + ``noise``·N(0, 1)), the engine's
    top-K ids and both log-probs there."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, v, generator=g, dtype=torch.float64) * 2
    engine = torch.log_softmax(logits, -1)
    trainer = torch.log_softmax(logits + noise * torch.randn(t, v, generator=g, dtype=torch.float64), -1)
    ids = engine.topk(k, dim=-1).indices
    return engine, trainer, ids, engine.gather(1, ids), trainer.gather(1, ids)


def test_identical_distributions_give_exactly_zero():
    _, _, _, p, _ = _distributions()
    assert torch.equal(topk_parity_kl(p, p.clone()), torch.zeros(p.shape[0], dtype=torch.float64))
    assert torch.equal(topk_parity_kl(p.float(), p.float()), torch.zeros(p.shape[0], dtype=torch.float64))


def test_kl_equals_an_independent_float64_computation_and_rises_with_the_perturbation():
    means = []
    for noise in (0.01, 0.1, 0.5):
        _, _, _, p, q = _distributions(noise=noise)
        kl = topk_parity_kl(p, q)
        ref = [_reference_kl(a, b) for a, b in zip(p.tolist(), q.tolist(), strict=True)]
        assert kl.tolist() == pytest.approx(ref, rel=1e-9, abs=1e-15)
        assert bool((kl >= 0).all())
        means.append(kl.mean().item())
    assert 0 < means[0] < means[1] < means[2], means


def test_kl_is_a_lower_bound_on_the_full_vocabulary_kl():
    engine, trainer, _, p, q = _distributions(noise=0.3)
    full = (engine.exp() * (engine - trainer)).sum(-1)
    assert bool((topk_parity_kl(p, q) <= full + 1e-12).all())


def test_the_tail_bucket_sees_mass_moved_to_the_rest_of_the_vocabulary():
    """A trainer whose K probabilities are all the engine's times 0.8 (the rest moved to other tokens):
    renormalised over the K ids the two agree (KL 0); with the tail bucket the KL is clearly positive."""
    _, _, _, p, _ = _distributions()
    q = p + math.log(0.8)
    renormalised = (torch.softmax(p, -1) * (torch.log_softmax(p, -1) - torch.log_softmax(q, -1))).sum(-1)
    assert renormalised.abs().max().item() < 1e-12
    assert topk_parity_kl(p, q).min().item() > 1e-3


def test_misaligned_rows_read_far_from_zero():
    """The bug the metric exists to catch: the trainer's log-probs of the right ids at the wrong position."""
    _, trainer, ids, p, _ = _distributions(noise=0.0)
    aligned = topk_parity_kl(p, trainer.gather(1, ids))
    shifted = topk_parity_kl(p[1:], trainer[:-1].gather(1, ids[1:]))  # engine row t+1 against trainer row t
    assert aligned.abs().max().item() < 1e-12
    assert shifted.mean().item() > 0.1


def test_shape_mismatch_is_refused():
    with pytest.raises(ValueError, match=r"\[T, K\]"):
        topk_parity_kl(torch.zeros(3, 2), torch.zeros(3, 3))


# ------------------------------------------------------------------------------ SGLang's wire format


def test_generate_request_carries_top_logprobs_num_only_when_asked():
    body, _ = build_generate_request([[1, 2]], SamplingParams(n=2, top_logprobs=4))
    assert body["top_logprobs_num"] == 4
    assert "top_logprobs_num" not in build_generate_request([[1]], SamplingParams())[0]
    body = build_requests_body([[1], [2]], [SamplingParams(top_logprobs=3)] * 2)
    assert body["top_logprobs_num"] == 3
    with pytest.raises(EngineError, match="top_logprobs"):
        build_requests_body([[1], [2]], [SamplingParams(top_logprobs=3), SamplingParams()])


def test_output_top_logprobs_parse_into_tensors():
    top = (torch.tensor([[7, 3], [8, 1], [2, 9]]), torch.tensor([[-0.5, -1.5], [-1.0, -2.0], [-0.1, -3.0]]))
    out = sglang_output([7, 8, 2], [-0.5, -1.0, -0.1], {"type": "stop", "matched": 2}, "4", top=top)
    assert out["meta_info"]["output_top_logprobs"][1] == [[-1.0, 8, None], [-2.0, 1, None]]  # SGLang's rows
    [[c]] = parse_generate_response([out], [(0, 0)], 1, weight_version=4, top_logprobs=2)
    assert torch.equal(c.top_ids, top[0]) and torch.equal(c.top_logprobs, top[1])
    assert c.top_ids.dtype == torch.long and c.top_logprobs.dtype == torch.float32
    [[plain]] = parse_generate_response([out], [(0, 0)], 1, weight_version=4)
    assert plain.top_ids is None and plain.top_logprobs is None


@pytest.mark.parametrize("drop", ["missing", "short", "ragged"])
def test_malformed_output_top_logprobs_are_refused(drop):
    top = (torch.tensor([[7, 3], [8, 1]]), torch.tensor([[-0.5, -1.5], [-1.0, -2.0]]))
    out = sglang_output([7, 8], [-0.5, -1.0], {"type": "stop"}, "4", top=top)
    meta = out["meta_info"]
    if drop == "missing":
        del meta["output_top_logprobs"]
    elif drop == "short":
        meta["output_top_logprobs"] = meta["output_top_logprobs"][:1]
    else:
        meta["output_top_logprobs"][1] = meta["output_top_logprobs"][1][:1]
    with pytest.raises(EngineError, match="output_top_logprobs"):
        parse_generate_response([out], [(0, 0)], 1, weight_version=4, top_logprobs=2)


def test_partial_rollouts_keep_both_segments_top_k_rows():
    a = Completion(
        0,
        [1, 2],
        [-1.0, -2.0],
        "abort",
        1,
        top_ids=torch.tensor([[1, 5], [2, 6]]),
        top_logprobs=torch.tensor([[-1.0, -2.0], [-2.0, -3.0]]),
    )
    b = Completion(
        0, [3], [-0.5], "stop", 2, top_ids=torch.tensor([[3, 4]]), top_logprobs=torch.tensor([[-0.5, -1.0]])
    )
    m = merge_segments(a, b, prompt_len=4)
    assert m.top_ids.tolist() == [[1, 5], [2, 6], [3, 4]]
    assert m.top_logprobs.tolist() == [[-1.0, -2.0], [-2.0, -3.0], [-0.5, -1.0]]


# ------------------------------------------------------------------------------ trainer bookkeeping


def _sample(n: int, k: int | None) -> Sample:
    ids = None if k is None else torch.arange(n * k).reshape(n, k)
    logp = None if k is None else -torch.ones(n, k)
    return Sample(0, 0, [1], list(range(n)), [-1.0] * n, engine_top_ids=ids, engine_top_logp=logp)


def test_engine_top_k_lays_rows_out_in_sample_order_and_refuses_misfits():
    top = engine_top_k([_sample(2, 3), _sample(1, None), _sample(3, 3)], 3, torch.device("cpu"))
    assert top is not None
    assert top.have.tolist() == [True, True, False, True, True, True]
    assert top.ids[3:].tolist() == torch.arange(9).reshape(3, 3).tolist()
    assert engine_top_k([_sample(2, 3)], 0, torch.device("cpu")) is None
    with pytest.raises(ValueError, match="parity_top_k=4"):
        engine_top_k([_sample(2, 3)], 4, torch.device("cpu"))
    bad = _sample(2, 3)
    bad = Sample(
        0,
        0,
        [1],
        [5, 6, 7],
        [-1.0] * 3,
        engine_top_ids=bad.engine_top_ids,
        engine_top_logp=bad.engine_top_logp,
    )
    with pytest.raises(ValueError, match="3 response tokens"):
        engine_top_k([bad], 3, torch.device("cpu"))


def test_parity_stats_and_step_metrics():
    top = engine_top_k([_sample(2, 3), _sample(1, None)], 3, torch.device("cpu"))
    top.kl[:] = torch.tensor([0.25, 0.5, 99.0], dtype=torch.float64)  # the row without engine data is ignored
    s = parity_stats(top)
    assert (s.topk_kl_sum, s.topk_kl_max, s.topk_kl_tokens) == (0.75, 0.5, 2.0)
    m = step_metrics(RolloutBatch([]), s, 0.0, 1.0)
    assert m["logprob/topk_kl_mean"] == 0.375 and m["logprob/topk_kl_max"] == 0.5
    off = step_metrics(RolloutBatch([]), StepStats(), 0.0, 1.0)
    assert "logprob/topk_kl_mean" not in off and "logprob/topk_kl_max" not in off
