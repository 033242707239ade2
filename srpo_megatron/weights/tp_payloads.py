"""One SGLang payload per engine TP rank, each made on the GPU that rank runs on (colocated placement).

SGLang's ``update_weights_from_tensor`` takes ``serialized_named_tensors``, one entry per scheduler TP
rank, and rank i deserializes only entry i (``TpModelWorker``: ``serialized_named_tensors[tp_rank]``,
sglang 0.5.15.post1 and 0.5.23). An entry is a ``MultiprocessingSerializer`` string whose tensor is a CUDA
IPC handle, so entry i must point at memory on GPU i: one payload copied to every rank would make each
scheduler map the host's GPU. slime does it the same way (``update_weight_from_tensor.py``,
``_send_to_colocated_engine``, THUDM/slime 04b6c8d): each trainer rank of the engine's GPUs serializes its
own copy and a ``gather_object`` brings the strings to the rank that talks to the engine.

Here the engine's host ``h`` (its TP rank 0, ``rollout.placement.EngineLayout``) holds each flat bucket
(``buckets.FlatBucket``, built by its own stage or received from another stage) and the engine's other
ranks are its *peers*. For every bucket the host sends the bucket to peer i (``weights.p2p`` wire, on the
device group: a GPU-to-GPU copy), peer i serializes its copy and sends the string back (gloo), and the
host sends the list to SGLang. A peer keeps its copy until the host's next command: the host sends one
only after SGLang answered, i.e. after every scheduler copied out of it.

The peers also take part in the host's gathers (TP shards, expert groups), whose points in time only the
host knows: before each parameter fetch the host names it, and the peer joins that fetch on its side.
So a peer runs one command loop, ``serve_engine_peer``, in the host's order, and nothing can interleave
differently on the two sides.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from srpo_megatron.buckets import FlatBucket, PendingParam
from srpo_megatron.rollout.sglang.protocol import flat_bucket_data, serialize_payload
from srpo_megatron.weights.p2p import P2PChannel, WeightSyncError, send_bucket

FETCH, BUCKET, DONE = 1, 2, 3


def _send_blob(ch: P2PChannel, kind: int, blob: bytes) -> None:
    ch.send_meta(torch.tensor([kind, len(blob)], dtype=torch.int64))
    if blob:
        ch.send_meta(torch.frombuffer(bytearray(blob), dtype=torch.uint8))


def _recv_blob(ch: P2PChannel) -> tuple[int, bytes]:
    header = torch.zeros(2, dtype=torch.int64)
    ch.recv_meta(header)
    kind, n = int(header[0]), int(header[1])
    if not n:
        return kind, b""
    blob = torch.empty(n, dtype=torch.uint8)
    ch.recv_meta(blob)
    return kind, bytes(blob.tolist())


class EnginePeers:
    """The host's side: ``peers`` are the engine's other ranks in order (engine TP rank 1, 2, ...; the
    first ``tp_size - 1`` of them get buckets, all of them follow the fetches)."""

    def __init__(self, peers: list[int], host_group: dist.ProcessGroup | None, tp_size: int) -> None:
        if tp_size - 1 > len(peers):
            raise WeightSyncError(
                f"the SGLang engine has tp_size={tp_size} but its colocated group has {len(peers) + 1} "
                "ranks; set rollout.gpus_per_engine to the engine's TP size"
            )
        self.channels = [P2PChannel(r, host_group) for r in peers]
        self.tp_size = tp_size

    def announce(self, name: str) -> None:
        """Before the host's fetch of parameter ``name``: every peer joins it."""
        for ch in self.channels:
            _send_blob(ch, FETCH, name.encode())

    def payloads(self, bucket: FlatBucket, version: int) -> list[str]:
        """Engine TP ranks 1..tp-1: each gets ``bucket`` and returns its own copy serialized."""
        receivers = self.channels[: self.tp_size - 1]
        for ch in receivers:
            _send_blob(ch, BUCKET, b"")
            send_bucket(ch, bucket, version)
        out = []
        for ch in receivers:
            _, blob = _recv_blob(ch)
            out.append(blob.decode())
        return out

    def done(self) -> None:
        for ch in self.channels:
            _send_blob(ch, DONE, b"")

    def wrap(self, pending: Iterable[PendingParam]) -> Iterator[PendingParam]:
        """``pending`` with each fetch announced first (the host's side of ``serve_engine_peer``)."""
        for p in pending:
            fetch_into = p.fetch_into and functools.partial(self._announced, p.name, p.fetch_into)
            yield dataclasses.replace(
                p, fetch=functools.partial(self._announced, p.name, p.fetch), fetch_into=fetch_into
            )

    def _announced(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        self.announce(name)
        return fn(*args)


def serve_engine_peer(
    host: int,
    pending: Iterable[PendingParam],
    host_group: dist.ProcessGroup | None,
    device: torch.device | str,
    version: int,
    serializer: Callable[[Any], str] | None = None,
) -> None:
    """A peer's side, until the host's done: join each fetch the host names (``pending``: this rank's
    own parameters of the host's stage, unfused, in model order), and serialize each bucket received."""
    ch = P2PChannel(host, host_group)
    todo = iter(pending)
    held: list[FlatBucket] = []  # this rank's copy of the bucket SGLang is reading
    while True:
        kind, blob = _recv_blob(ch)
        held.clear()  # the host sends a command only after SGLang answered the last bucket
        if kind == FETCH:
            name = blob.decode()
            for p in todo:
                p.fetch()
                if p.name == name:
                    break
            else:
                raise WeightSyncError(f"engine host {host} fetches {name}, which this rank never had")
        elif kind == BUCKET:
            header = torch.zeros(2, dtype=torch.int64)  # send_bucket's: JSON length, 0
            ch.recv_meta(header)
            raw = torch.empty(int(header[0]), dtype=torch.uint8)
            ch.recv_meta(raw)
            meta = json.loads(bytes(raw.tolist()).decode())
            if meta["version"] != version:
                raise WeightSyncError(f"bucket of version {meta['version']} during the sync of {version}")
            bucket = FlatBucket.from_meta(meta, device)
            ch.recv(bucket.flat)
            _send_blob(ch, 0, serialize_payload(flat_bucket_data(bucket), serializer).encode())
            held.append(bucket)
        elif kind == DONE:
            for p in todo:  # what the host's stage never fetched (none when the plans agree)
                p.fetch()
            return
        else:
            raise WeightSyncError(f"unknown command {kind} from engine host {host}")
