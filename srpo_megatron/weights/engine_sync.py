"""Weight sync into many colocated rollout engines, each fed by the data-parallel replica it sits in.

Engine k is hosted on global rank ``h = k * size`` (``rollout.placement.EngineLayout``), a TP rank 0. Its
feed is the replica ``dp(h)``: that replica's TP groups gather their stage's parameters onto their TP rank 0
(the stage sender of the replica) and the senders stream byte-bounded buckets to ``h`` — locally for
``h``'s own stage, point-to-point (the wire format of ``weights.p2p``) for the others, in stage order.
No replica feeds another replica's engine and nothing funnels through global rank 0: with PP=1 and
``size`` = the replica's ranks, each engine is fed entirely by its own ranks.

Collective over all trainer ranks. ``targets`` limits the sync to some engines (a restarted engine is
resynced alone); replicas that feed no target do nothing. A sender holds at most one bucket plus what
gathering one parameter needs: each bucket is one flat buffer (``buckets.flat_buckets``) that the
gathered, converted parameters are written into, sent as one tensor to every target host of its replica
(``weights.p2p``; it receives it into one buffer) and handed to its own engine as views, before the next
is made.

``ColocatedSync`` is the ``WeightSync`` strategy on top (``weights.weight_sync``): the host hands the stream
to ``engine.update_weights`` (the CPU engine copies it; SGLang sends it by CUDA IPC,
``/update_weights_from_tensor``). ``weights.disk_sync`` reuses the feed with another receiver.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from srpo_megatron.buckets import flat_buckets, streamed_views
from srpo_megatron.conversion.fp8_layout import Fp8Layout
from srpo_megatron.conversion.lora_table import LoraTable
from srpo_megatron.conversion.table import ConversionTable
from srpo_megatron.parallel import ParallelGroups
from srpo_megatron.rollout.base import EngineError, RolloutEngine
from srpo_megatron.rollout.placement import EngineLayout
from srpo_megatron.weights.export import iter_stage_params
from srpo_megatron.weights.fp8_sync import quantize_pending
from srpo_megatron.weights.fused_experts import fuse_expert_slices
from srpo_megatron.weights.lora_stream import iter_stage_adapters
from srpo_megatron.weights.p2p import (
    DEFAULT_BUCKET_BYTES,
    P2PChannel,
    WeightSyncError,
    receive_buckets,
    receive_stream,
    send_bucket,
    send_done,
)
from srpo_megatron.weights.sync_common import agree_failures
from srpo_megatron.weights.tp_payloads import EnginePeers, serve_engine_peer


def grid(groups: ParallelGroups) -> list[tuple[int, int, int]]:
    """``(dp, pp, tp)`` of every global rank (a collective over the gloo host group).

    Under context parallelism a replica's stage is a TP x CP group whose CP ranks hold the same weights
    and only CP rank 0 exports them (weights/export.py), so the "tp" reported here is the rank within
    the TP x CP group (``tp + cp * TP``, megatron's tp-fastest order): its rank 0 is the stage sender.
    """
    everyone: list[Any] = [None] * dist.get_world_size()
    within = groups.tp_rank + groups.cp_rank * groups.tp_size
    dist.all_gather_object(everyone, (groups.dp_rank, groups.pp_rank, within), group=groups.host)
    return [tuple(x) for x in everyone]


def engine_feeds(
    layout: EngineLayout, coords: list[tuple[int, int, int]], targets: Iterable[int]
) -> dict[int, list[int]]:
    """For each target engine: the global ranks that stream it its stages, in stage order."""
    sender = {(d, p): r for r, (d, p, t) in enumerate(coords) if t == 0}
    pp_size = 1 + max(p for _, p, _ in coords)
    feeds = {}
    for k in targets:
        h = layout.hosts[k]
        d, _, t = coords[h]
        if t != 0:
            raise WeightSyncError(
                f"engine {k} is hosted on rank {h}, which is TP rank {t}: rollout.gpus_per_engine="
                f"{layout.size} must be a multiple of parallel.tp x parallel.cp so each engine starts on the "
                "first rank of a TP x CP group"
            )
        feeds[k] = [sender[(d, p)] for p in range(pp_size)]
    return feeds


def sync_engines(
    model: torch.nn.Module,
    table: ConversionTable,
    groups: ParallelGroups,
    engine: Any | None,
    version: int,
    layout: EngineLayout,
    *,
    targets: Iterable[int] | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    dtype: torch.dtype | None = None,
    fuse_experts: bool = False,
    fp8: Fp8Layout | None = None,
    tp_payloads: bool = False,
    adapters: LoraTable | None = None,
) -> int:
    """Collective: install the policy as ``version`` into each target engine (``engine`` is this rank's
    engine on hosts, None elsewhere). Returns the bytes this rank sent to other ranks. An engine that
    rejects the update raises on its host only, after the rest of its stream was drained, so the other
    ranks complete the collective; the caller agrees on failures afterwards (``RolloutService.sync``).
    ``fuse_experts`` (SGLang engines; the same on every rank): whole fused expert tensors instead of the
    table's slices ``x[e]`` (``weights.fused_experts``; gpt-oss). ``fp8``: the engines serve this blockwise
    FP8 layout, each FP8 weight goes quantized with its ``weight_scale_inv`` (``weights.fp8_sync``).
    ``tp_payloads`` (SGLang engines; the same on every rank): the host hands its engine whole flat buckets
    (``update_weight_buckets``, one copy) and the engine's other ranks serialize their own copies for their
    TP ranks (``weights.tp_payloads``)."""
    me = dist.get_rank()
    targets = sorted(range(layout.num_engines) if targets is None else targets)
    coords = grid(groups)
    feeds = engine_feeds(layout, coords, targets)
    my_dp, _my_pp, my_tp = coords[me]
    # Hosts this replica feeds (this rank's stage goes to each of them), in engine order.
    receivers = [layout.hosts[k] for k in targets if coords[layout.hosts[k]][0] == my_dp]
    if adapters is not None:
        pending = iter_stage_adapters(model, adapters, groups, dtype, all_replicas=True)
    else:
        pending = iter_stage_params(model, table, groups, dtype, all_replicas=True)
    my_engine = layout.engine_of(me) if me in layout.hosts else None
    peers = None
    if tp_payloads and layout.size > 1:
        served, peers = _tp_payload_role(me, engine, layout, coords, targets, feeds, groups, pending, version)
        if served:
            return 0
        if peers is not None:
            pending = peers.wrap(pending)
    if fuse_experts:
        pending = fuse_expert_slices(pending, table)
    pending = quantize_pending(pending, fp8)
    if not receivers:
        # This replica feeds no engine in this sync. MoE expert gathers run over EP/ETP groups that may
        # span replicas, so then it still joins every gather (and drops the result).
        if table.arch.is_moe and (groups.ep_size > 1 or groups.etp_size > 1):
            for p in pending:
                p.fetch()
        return 0
    if my_tp != 0:  # join this stage's TP gathers; the stage sender does the rest
        for p in pending:
            p.fetch()
        return 0
    remote = [h for h in receivers if h != me]
    sent = 0

    def my_stage() -> Iterator[Any]:
        nonlocal sent
        for bucket in flat_buckets(pending, bucket_bytes, groups.device):
            for h in remote:
                send_bucket(P2PChannel(h, groups.host), bucket, version)
                sent += bucket.nbytes
            if me in receivers and tp_payloads:
                yield bucket  # the SGLang engine sends the buffer itself (one copy)
            elif me in receivers:
                yield from streamed_views(bucket)  # the local engine installs from views of the bucket
            del bucket  # release it before the next one is gathered
        for h in remote:
            send_done(P2PChannel(h, groups.host))

    if my_engine is not None and my_engine in feeds:
        if engine is None:
            raise WeightSyncError(f"rank {me} hosts engine {my_engine} but got engine=None")

        def stream() -> Iterator[Any]:
            for src in feeds[my_engine]:
                if src == me:
                    yield from my_stage()
                elif tp_payloads:
                    yield from receive_buckets(P2PChannel(src, groups.host), version, groups.device)
                else:
                    yield from receive_stream(P2PChannel(src, groups.host), version, groups.device)

        feed = stream()
        try:
            if tp_payloads:
                engine.update_weight_buckets(feed, version, peers)
            else:
                engine.update_weights(feed, version)
        except Exception:
            for _ in feed:  # drain: the senders (and the engine's peers) follow this host's stream
                pass
            raise
        finally:
            if peers is not None:
                peers.done()
    else:
        for _ in my_stage():
            pass
    return sent


def _check_peer_layout(layout: EngineLayout, coords: list[tuple[int, int, int]], targets: list[int]) -> None:
    """Every rank: an engine's peers serve its host only, so none may be another stage's sender."""
    for k in targets:
        if len({coords[r][1] for r in layout.ranks_of(k)}) > 1:
            raise WeightSyncError(
                f"engine {k} spans pipeline stages (ranks {layout.ranks_of(k)}): rollout.gpus_per_engine="
                f"{layout.size} must not exceed the ranks of one stage (parallel.tp x cp x dp)"
            )


def _tp_payload_role(
    me: int,
    engine: Any,
    layout: EngineLayout,
    coords: list[tuple[int, int, int]],
    targets: list[int],
    feeds: dict[int, list[int]],
    groups: ParallelGroups,
    pending: Iterable[Any],
    version: int,
) -> tuple[bool, EnginePeers | None]:
    """An engine over several ranks (``tp_payloads``): a peer serves its host until done (True); the
    host gets the ``EnginePeers`` that make its other TP ranks' payloads."""
    _check_peer_layout(layout, coords, targets)
    k = layout.engine_of(me)
    if k in targets and me != layout.hosts[k]:
        serve_engine_peer(layout.hosts[k], pending, groups.host, groups.device, version)
        return True, None
    if me not in layout.hosts or k not in feeds:
        return False, None
    if engine is None:
        raise WeightSyncError(f"rank {me} hosts engine {k} but got engine=None")
    return False, EnginePeers(layout.ranks_of(k)[1:], groups.host, engine.tp_size)


class ColocatedSync:
    """``WeightSync`` for engines fed from the trainer's own ranks (module docstring); ``receiver`` is what
    a host hands its stream to (the engine itself here; ``DiskSync`` writes a folder instead).
    ``fuse_experts``: SGLang engines load gpt-oss's fused expert tensors whole (``sync_engines``); the
    transformers engine takes the table's slices. ``fp8``: the served blockwise FP8 layout (None: bf16).
    ``tp_payloads``: SGLang engines get whole flat buckets and one payload per TP rank
    (``weights.tp_payloads``)."""

    def __init__(
        self,
        policy: Any,
        groups: ParallelGroups,
        layout: EngineLayout,
        *,
        fuse_experts: bool = False,
        fp8: Fp8Layout | None = None,
        tp_payloads: bool = False,
    ) -> None:
        self.policy, self.groups, self.layout = policy, groups, layout
        self.fuse_experts, self.fp8, self.tp_payloads = fuse_experts, fp8, tp_payloads

    def receiver(self, engine: RolloutEngine) -> Any:
        return engine

    def push(self, engine: RolloutEngine | None, version: int, targets: list[int] | None) -> dict[int, str]:
        error = ""
        try:
            self._sync(self.receiver(engine) if engine is not None else None, version, targets)
        except EngineError as e:  # on its host only; the others completed the collective
            error = str(e)
        return agree_failures(self.layout, self.groups.host, self.layout.engine_of(dist.get_rank()), error)

    def _sync(self, receiver: Any, version: int, targets: list[int] | None) -> None:
        p = self.policy
        sync_engines(
            p.model,
            p.table,
            self.groups,
            receiver,
            version,
            self.layout,
            targets=targets,
            fuse_experts=self.fuse_experts,
            fp8=self.fp8,
            tp_payloads=self.tp_payloads,
        )

    def engines_restarted(self, engines: list[int]) -> None:
        """Nothing to forget: a rebuilt engine takes the next push like any other."""

    def close(self) -> None:
        pass
