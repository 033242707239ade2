"""Weight-sync transports for tests and the bench only; `srpo train` never reaches them.

Production moves weights with ``weights.weight_sync`` (colocated, broadcast, disk). These older
transports stay because they check the export/conversion stream against independent receivers
(tests/dist/test_weight_sync.py, tests/dist/test_strict_device.py, the SGLang-real tier) and because
tools/bench_weight_sync.py measures the sender's and an engine process's memory with them:

- **in-process** (``sync_in_process``): the engine object lives in the trainer process of global rank
  ``engine_rank`` (the first stage's sender); the other stages' senders ship their buckets to it
  point-to-point (``weights.p2p``);
- **stage channel** (``StageChannel`` + ``send_stage`` / ``receive_update``): a separate engine process
  joins one two-member process group per PP stage (that stage's sender is rank 0, the engine rank 1)
  and receives each bucket by broadcast from the sender, then acknowledges the version;
- **disk folder** (``save_stage_shards`` / ``load_synced_folder``): each stage's sender writes
  safetensors shards; after a barrier rank 0 writes ``sync.json`` last, which names the version and the
  shards, so a reader never sees a half-written version.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from srpo_megatron.buckets import FlatBucket, bucketize, bucketize_pending, flat_buckets
from srpo_megatron.conversion.table import ConversionTable
from srpo_megatron.parallel import ParallelGroups
from srpo_megatron.weights.export import is_stage_sender, iter_stage_hf_tensors, iter_stage_params
from srpo_megatron.weights.p2p import (
    DEFAULT_BUCKET_BYTES,
    P2PChannel,
    WeightSyncError,
    receive_stream,
    send_bucket,
    send_done,
)


class StageChannel:
    """A two-member process group {stage sender = 0, engine = 1}, built from its own TCPStore so the
    engine process need not be part of the trainer's world. Data moves by ``broadcast`` from rank 0.

    Headers, JSON metadata and acknowledgements are host tensors and always go over a gloo group; the
    weight tensors go over the ``backend`` group (NCCL on GPU, where they are device tensors)."""

    def __init__(
        self, host: str, port: int, rank: int, timeout_s: float = 600.0, backend: str = "gloo"
    ) -> None:
        timeout = datetime.timedelta(seconds=timeout_s)
        self._store = dist.TCPStore(host, port, 2, rank == 0, timeout=timeout)
        self._meta = dist.ProcessGroupGloo(dist.PrefixStore("meta", self._store), rank, 2, timeout)
        if backend == "gloo":
            self._pg = self._meta
        else:
            self._pg = dist.ProcessGroupNCCL(dist.PrefixStore("data", self._store), rank, 2)
        self.rank = rank

    @staticmethod
    def _bcast_on(pg, t: torch.Tensor, root: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        pg.broadcast([t], opts).wait()

    def send(self, t: torch.Tensor) -> None:
        self._bcast_on(self._pg, t, 0)

    recv = send

    def send_meta(self, t: torch.Tensor) -> None:
        self._bcast_on(self._meta, t, 0)

    recv_meta = send_meta

    def ack(self, version: int) -> None:
        """Engine side: confirm that ``version`` is installed (the sender's ``wait_ack`` returns it)."""
        self._bcast_on(self._meta, torch.tensor([version], dtype=torch.int64), 1)

    def wait_ack(self) -> int:
        """Sender side: block until the engine confirms; returns the version it now serves."""
        t = torch.zeros(1, dtype=torch.int64)
        self._bcast_on(self._meta, t, 1)
        return int(t)


def _bucket_bytes(bucket: list[tuple[str, torch.Tensor]] | FlatBucket) -> int:
    if isinstance(bucket, FlatBucket):
        return bucket.nbytes
    return sum(t.numel() * t.element_size() for _, t in bucket)


def send_buckets(ch, buckets: Iterable[list[tuple[str, torch.Tensor]] | FlatBucket], version: int) -> int:
    """Send buckets over ``ch``, then the done marker; returns the bytes sent."""
    sent = 0
    for bucket in buckets:
        send_bucket(ch, bucket, version)
        sent += _bucket_bytes(bucket)
        del bucket  # release it before the generator materialises the next one
    send_done(ch)
    return sent


def send_stream(ch, stream: Iterable[tuple[str, torch.Tensor]], version: int, bucket_bytes: int) -> int:
    """Send a stream of tensors over ``ch`` in buckets of at most ``bucket_bytes``; returns bytes sent."""
    return send_buckets(ch, bucketize(stream, bucket_bytes), version)


# --------------------------------------------------------------------------------------- in-process


def _stage_senders(groups: ParallelGroups) -> list[int]:
    """Global rank of each PP stage's sender, in stage order (collective over the gloo host group)."""
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, groups.pp_rank if is_stage_sender(groups) else -1, group=groups.host)
    senders = {int(p): r for r, p in enumerate(everyone) if int(p) >= 0}
    return [senders[p] for p in range(groups.pp_size)]


def sync_in_process(
    model: torch.nn.Module,
    table: ConversionTable,
    groups: ParallelGroups,
    engine: Any | None,
    version: int,
    *,
    engine_rank: int = 0,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    dtype: torch.dtype | None = None,
) -> None:
    """Collective over all trainer ranks: install the policy into ``engine`` (given on ``engine_rank`` only)
    as ``version``. ``engine_rank`` must be the first stage's sender (global rank 0 in megatron's order)."""
    senders = _stage_senders(groups)
    if senders[0] != engine_rank:
        raise WeightSyncError(
            f"engine_rank={engine_rank} is not the first pipeline stage's sender (rank {senders[0]}); "
            "host the in-process engine there"
        )
    me = dist.get_rank()
    if me == engine_rank:
        local = iter_stage_hf_tensors(model, table, groups, dtype)
        if engine is None:
            raise WeightSyncError(f"rank {me} hosts the engine but got engine=None")

        def stream():
            yield from local
            for peer in senders[1:]:
                yield from receive_stream(P2PChannel(peer, groups.host), version, groups.device)

        engine.update_weights(stream(), version)
        return
    pending = iter_stage_params(model, table, groups, dtype)
    if me in senders:
        buckets = flat_buckets(pending, bucket_bytes, groups.device)
        send_buckets(P2PChannel(engine_rank, groups.host), buckets, version)
    else:
        for p in pending:  # join this stage's TP gathers
            p.fetch()


# ----------------------------------------------------------------------- stage channel (engine process)


def send_stage(
    model: torch.nn.Module,
    table: ConversionTable,
    groups: ParallelGroups,
    channel: StageChannel | None,
    version: int,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    dtype: torch.dtype | None = None,
) -> int:
    """Trainer side, collective over the stage's TP group: the stage sender (which holds ``channel``)
    broadcasts its stage to the engine process and waits for the engine's acknowledgement (sent once
    every stage arrived and the engine installed the version). Returns bytes sent (0 on non-senders)."""
    pending = iter_stage_params(model, table, groups, dtype)
    if is_stage_sender(groups):
        if channel is None:
            raise WeightSyncError("this rank is its stage's sender but has no StageChannel to the engine")
        sent = send_buckets(channel, flat_buckets(pending, bucket_bytes, groups.device), version)
        served = channel.wait_ack()
        if served != version:
            raise WeightSyncError(f"engine serves version {served} after the sync of version {version}")
        return sent
    for p in pending:
        p.fetch()
    return 0


def receive_update(
    engine: Any, channels: list[StageChannel], version: int | None = None, device: torch.device | str = "cpu"
) -> int:
    """Engine process: receive one sync of ``version`` (default: the engine's next) from all stages, in
    stage order, into ``engine``, acknowledge it on every channel; returns the version.

    ``device``: where the weight tensors are received (the engine's device with an NCCL channel)."""
    version = engine.weight_version + 1 if version is None else version

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        for ch in channels:
            yield from receive_stream(ch, version, device)

    engine.update_weights(stream(), version)
    for ch in channels:
        ch.ack(engine.weight_version)
    return version


# ------------------------------------------------------------------------------------------------ disk


def save_stage_shards(
    model: torch.nn.Module,
    table: ConversionTable,
    groups: ParallelGroups,
    folder: str | Path,
    version: int,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    dtype: torch.dtype | None = None,
) -> None:
    """Collective over all trainer ranks: write the policy as safetensors shards + ``sync.json`` (last)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    if dist.get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "sync.json").unlink(missing_ok=True)
        for old in folder.glob("*.safetensors"):
            old.unlink()
    dist.barrier()
    files = []
    buckets = bucketize_pending(iter_stage_params(model, table, groups, dtype), bucket_bytes)
    for k, bucket in enumerate(buckets):
        name = f"model-stage{groups.pp_rank:03d}-{k:05d}.safetensors"
        save_file(dict(bucket), str(folder / name), metadata={"version": str(version)})
        files.append(name)
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, files, group=groups.host)
    if dist.get_rank() == 0:
        shards = sorted(f for fs in everyone for f in fs)
        (folder / "sync.json").write_text(json.dumps({"version": version, "shards": shards}))
    dist.barrier()


def load_synced_folder(folder: str | Path) -> tuple[int, Iterator[tuple[str, torch.Tensor]]]:
    """Engine side: ``(version, stream)`` of a folder written by ``save_stage_shards``."""
    from safetensors import safe_open

    folder = Path(folder)
    marker = folder / "sync.json"
    if not marker.exists():
        raise WeightSyncError(f"{folder} has no sync.json: the trainer has not finished writing a version")
    info = json.loads(marker.read_text())

    def stream():
        for shard in info["shards"]:
            with safe_open(str(folder / shard), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    yield key, f.get_tensor(key)

    return int(info["version"]), stream()


# ------------------------------------------------------------------------- the disk route as one engine


class DiskRouted:
    """An ``SGLangEngine`` whose ``update_weights`` goes the way the disk strategy sends it
    (``weights.disk_sync.DiskInstall``: gate, folder, ``update_weights_from_disk``), everything else
    straight to the engine: the rollout contract tests run the disk route through it."""

    def __init__(self, engine: Any, folder: str | Path, manifest: dict[str, tuple[int, ...]]) -> None:
        from srpo_megatron.weights.disk_sync import DiskInstall

        aliases = frozenset(a for a in ("lm_head.weight",) if a not in manifest)
        self._engine = engine
        self._install = DiskInstall(
            engine, folder, manifest, aliases, engine.cfg.model_path, engine.cfg.bucket_bytes
        )

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        self._install.update_weights(named_tensors, version)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)
