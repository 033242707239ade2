"""The point-to-point wire between trainer ranks: a stage sender streams flat buckets to an engine host.

What the colocated sync (``weights.engine_sync``) uses when an engine's host is not the sender of every
stage. Per bucket: an int64 ``[2]`` header (JSON length, done flag), the JSON ``{"version", "names",
"dtypes", "shapes"}`` as uint8, then the tensors. A flat bucket (``buckets.FlatBucket``, what the stage
senders send) adds ``"offsets"`` and ``"flat_bytes"`` to the JSON and is followed by its ONE flat uint8
buffer, received into one buffer. Headers and JSON are host tensors and travel over gloo (``send_meta``);
the weight tensors are on the runtime's device and travel over the default group (NCCL on GPU) into
receive buffers on the receiver's device. A final header with ``done = 1`` ends a stage's stream.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import torch
import torch.distributed as dist

from srpo_megatron.buckets import FlatBucket, streamed_views

DEFAULT_BUCKET_BYTES = 512 * 1024**2  # what a sender holds beyond the gather of one parameter


class WeightSyncError(RuntimeError):
    """A sync could not complete (stream broken, versions disagree); the engine keeps or refuses."""


class P2PChannel:
    """Point-to-point with ``peer``: metadata over the gloo ``host`` group, tensors over the default group
    (NCCL on GPU: the tensors are on the runtime's device)."""

    def __init__(self, peer: int, host: dist.ProcessGroup | None = None) -> None:
        self.peer, self.host = peer, host

    def send(self, t: torch.Tensor) -> None:
        dist.send(t, dst=self.peer)

    def recv(self, t: torch.Tensor) -> None:
        dist.recv(t, src=self.peer)

    def send_meta(self, t: torch.Tensor) -> None:
        dist.send(t, dst=self.peer, group=self.host)

    def recv_meta(self, t: torch.Tensor) -> None:
        dist.recv(t, src=self.peer, group=self.host)


def send_bucket(ch, bucket: list[tuple[str, torch.Tensor]] | FlatBucket, version: int) -> None:
    """One bucket: header, JSON, then the tensors (a ``FlatBucket``: its one flat buffer)."""
    if isinstance(bucket, FlatBucket):
        meta = {"version": version, **bucket.meta()}
    else:
        meta = {
            "version": version,
            "names": [n for n, _ in bucket],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket],
        }
    blob = torch.frombuffer(bytearray(json.dumps(meta).encode()), dtype=torch.uint8)
    ch.send_meta(torch.tensor([blob.numel(), 0], dtype=torch.int64))
    ch.send_meta(blob)
    if isinstance(bucket, FlatBucket):
        ch.send(bucket.flat)
        return
    for _, t in bucket:
        ch.send(t.contiguous())


def send_done(ch) -> None:
    """The end of one sender's stream."""
    ch.send_meta(torch.tensor([0, 1], dtype=torch.int64))


def read_bucket(ch, meta: dict, device: torch.device | str) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a bucket whose metadata arrived: received into one buffer (flat buckets: its last
    tensor a copy, see ``streamed_views``) or one buffer per tensor."""
    if "offsets" in meta:
        bucket = FlatBucket.from_meta(meta, device)
        ch.recv(bucket.flat)
        yield from streamed_views(bucket)
        return
    for name, dtype, shape in zip(meta["names"], meta["dtypes"], meta["shapes"], strict=True):
        t = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        ch.recv(t)
        yield name, t


def _bucket_metas(ch, version: int | None) -> Iterator[dict]:
    """Each bucket's metadata from a sender until its done marker, its version checked."""
    while True:
        header = torch.zeros(2, dtype=torch.int64)
        ch.recv_meta(header)
        if int(header[1]) == 1:
            return
        blob = torch.empty(int(header[0]), dtype=torch.uint8)
        ch.recv_meta(blob)
        meta = json.loads(bytes(blob.tolist()).decode())
        if version is not None and meta["version"] != version:
            raise WeightSyncError(f"bucket of version {meta['version']} arrived during the sync of {version}")
        yield meta


def receive_stream(
    ch, version: int | None = None, device: torch.device | str = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` from a sender until its done marker; checks every bucket's version.

    Metadata arrives in host tensors; the weight tensors are received into buffers on ``device``."""
    for meta in _bucket_metas(ch, version):
        yield from read_bucket(ch, meta, device)


def receive_buckets(
    ch, version: int | None = None, device: torch.device | str = "cpu"
) -> Iterator[FlatBucket]:
    """Like ``receive_stream``, for a sender of flat buckets: each bucket whole, received into one buffer
    (a consumer that sends buffers on, the SGLang engine, takes them as they are)."""
    for meta in _bucket_metas(ch, version):
        if "offsets" not in meta:
            raise WeightSyncError("receive_buckets needs a sender of flat buckets (buckets.flat_buckets)")
        bucket = FlatBucket.from_meta(meta, device)
        ch.recv(bucket.flat)
        yield bucket
