"""Size-bounded buckets for weight transfer (no megatron import: the rollout engines use it too)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch


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
