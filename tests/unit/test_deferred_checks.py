"""ops/deferred_checks.py: a check inside ``deferred()`` makes no host sync and raises its message only when
the caller's synced flags say it failed; outside, it raises at once. The token-id range check of
``token_stats`` goes through it, and the learning pass raises it at its one sync, before the optimizer."""

from __future__ import annotations

import math

import pytest
import torch

from srpo_megatron.ops import deferred_checks
from srpo_megatron.ops.vocab_parallel import token_stats
from srpo_megatron.trainer.passes.learning import _finite_and_stats

MESSAGE = r"ids must lie in \[0, 8\) \(the padded vocabulary\), got an id outside it"


def _model_with_grads() -> torch.nn.Module:
    model = torch.nn.Linear(2, 2)
    model(torch.ones(1, 2)).sum().backward()
    return model


def test_a_bad_id_raises_at_once_outside_deferral():
    with pytest.raises(ValueError, match=MESSAGE):
        token_stats(torch.zeros(3, 8), torch.tensor([[1], [8], [2]]))


@pytest.mark.parametrize("bad_id", [8, -1])
def test_a_bad_id_is_recorded_without_a_sync_and_raised_at_the_step_sync(bad_id, monkeypatch):
    def no_sync(t):
        raise AssertionError("a host sync inside deferred()")

    monkeypatch.setattr(torch.Tensor, "__bool__", no_sync)
    with deferred_checks.deferred() as checks:
        token_stats(torch.zeros(3, 8), torch.tensor([[1], [bad_id], [2]]))
    monkeypatch.undo()
    assert len(checks) == 1
    with pytest.raises(ValueError, match=MESSAGE):
        _finite_and_stats(_model_with_grads(), [], torch.device("cpu"), checks)


def test_good_ids_pass_the_step_sync():
    with deferred_checks.deferred() as checks:
        stats = token_stats(torch.zeros(3, 8), torch.tensor([[0], [7], [2]]))
    assert len(checks) == 1
    assert torch.allclose(stats.logp.double(), torch.full((3, 1), -math.log(8.0), dtype=torch.float64))
    finite, per_micro = _finite_and_stats(_model_with_grads(), [], torch.device("cpu"), checks)
    assert finite and per_micro == []
