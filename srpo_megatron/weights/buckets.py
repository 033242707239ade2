"""Size-bounded buckets for weight transfer (no megatron import: the rollout engines use it too)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch


@dataclass
class PendingParam:
    """One parameter not yet gathered: its HF byte size is known, ``fetch()`` materialises it."""

    name: str  # global megatron name
    nbytes: int  # bytes ``fetch()`` will return on this rank (0 where it returns nothing)
    fetch: Callable[[], list[tuple[str, torch.Tensor]]]


def bucketize(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a stream into lists of at most ``bucket_bytes`` (a tensor larger than that goes alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named_tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket


def bucketize_pending(
    pending: Iterable[PendingParam], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Like ``bucketize`` but decides *before* fetching: the current bucket is handed out (and released by
    the consumer) before a parameter that would overflow it is materialised. Every ``fetch`` is called,
    in order, also on ranks that get nothing (it may be a collective)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for p in pending:
        if bucket and size + p.nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        tensors = p.fetch()
        bucket.extend(tensors)
        size += sum(t.numel() * t.element_size() for _, t in tensors)
    if bucket:
        yield bucket
