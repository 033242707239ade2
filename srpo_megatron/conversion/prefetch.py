"""Produce the import's next tensor group while the current one is written (:class:`Prefetched`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch


class Prefetched:
    """``data_of(group)`` for ``groups`` taken in order, with the next group's data made in a worker thread
    while the caller writes the current one: the FP8 dequantization (torch ops, without the GIL) overlaps
    the ``writev`` of the previous group (a system call, without the GIL too).

    Memory: the next group is made ahead only when its data is at most ``budget`` bytes, so the peak grows
    by at most ``budget`` (an MoE's experts and a layer's projections are made ahead; the embedding and
    the output layer, the largest tensors, are not). At most one ``data_of`` runs at a time, so
    ``data_of`` needs no locking; it runs without ``__torch_function__`` dispatch in the worker too
    (``checkpoint.plain_torch_ops``)."""

    def __init__(
        self,
        data_of: Callable[[list[Any]], list[Any]],
        groups: list[list[Any]],
        budget: int = 4 << 20,
    ):
        self._data_of, self._groups, self._budget = data_of, groups, budget
        self._position = {id(g): i for i, g in enumerate(groups)}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="conversion-prefetch")
        self._pending: tuple[int, Future] | None = None

    def __call__(self, group: list[Any]) -> list[Any]:
        i = self._position[id(group)]
        pending, self._pending = self._pending, None
        data = pending[1].result() if pending is not None and pending[0] == i else self._data_of(group)
        if i + 1 < len(self._groups) and _nbytes(self._groups[i + 1]) <= self._budget:
            self._pending = (i + 1, self._pool.submit(self._plain, self._groups[i + 1]))
        return data

    def _plain(self, group: list[Any]) -> list[Any]:
        with torch._C.DisableTorchFunction():
            return self._data_of(group)

    def close(self) -> None:
        """Wait for a group made ahead (its error, if any, is dropped with it) and stop the worker."""
        self._pool.shutdown(wait=True)

    def __enter__(self) -> Prefetched:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _nbytes(group: list[Any]) -> int:
    """Bytes of a group of ``ShardedTensor`` s' data (their local shapes, in their dtypes)."""
    return sum(math.prod(sh.local_shape) * sh.dtype.itemsize for sh in group)


__all__ = ["Prefetched"]
