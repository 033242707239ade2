"""Checks on device values that wait for the step's one host sync instead of making their own.

``check(bad, message)`` raises ``ValueError(message)`` when the 0-dim bool ``bad`` is true. Outside
``deferred()`` it reads ``bad`` at once (a host sync). Inside, it only records ``bad``: the caller brings
every recorded flag to the host with the values it syncs anyway (``flags``) and raises the first failed
check's message (``raise_failed``) before acting on the step's results, e.g. before the optimizer step. A
check made this way must guard a computation that stays in bounds on the device when it fails (a masked
gather, not an out-of-range index), so the step runs to the sync and then stops with the clear message.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

Pending = list[tuple[torch.Tensor, str]]
_PENDING: contextvars.ContextVar[Pending | None] = contextvars.ContextVar("deferred_checks", default=None)


def check(bad: torch.Tensor, message: str) -> None:
    """Raise ``ValueError(message)`` if ``bad``: now, or inside ``deferred()`` at ``raise_failed``."""
    pending = _PENDING.get()
    if pending is None:
        if bool(bad):
            raise ValueError(message)
    else:
        pending.append((bad.detach().reshape(1), message))


@contextlib.contextmanager
def deferred() -> Iterator[Pending]:
    """Record the ``check`` calls made inside (no host sync); yields the list they fill."""
    pending: Pending = []
    token = _PENDING.set(pending)
    try:
        yield pending
    finally:
        _PENDING.reset(token)


def flags(pending: Pending) -> list[torch.Tensor]:
    """The recorded flags as float64 [1] tensors (1.0 = failed), to join a ``torch.cat(...).tolist()``."""
    return [bad.to(torch.float64) for bad, _ in pending]


def raise_failed(pending: Pending, values: list[float]) -> None:
    """Raise the message of the first recorded check whose synced flag (``values``, as ``flags``) is set."""
    for (_, message), value in zip(pending, values, strict=True):
        if value != 0.0:
            raise ValueError(message)


def raise_pending(pending: Pending) -> None:
    """``raise_failed`` for a caller with no sync of its own to join: one host sync for all the checks."""
    if pending:
        raise_failed(pending, torch.cat(flags(pending)).tolist())
