"""Weight sync into separately placed SGLang servers: NCCL broadcast from each PP stage's sender.

SGLang's convention (``/init_weights_update_group`` + ``/update_weights_from_distributed``), with slime's
``update_weight_from_distributed`` as the reference design:

- per PP stage one group ``srpo-pp{stage}-g{generation}``: rank 0 is the stage's sender (TP rank 0 of DP
  replica 0, which gathers the stage's parameters anyway), engine ``k``'s TP ranks are ``1 + sum(tp of
  engines before k) ...``; world size ``1 + sum(tp)``. Every server joins every stage's group, so one
  broadcast per tensor reaches all engines at once;
- per bucket the sender first posts ``update_weights_from_distributed`` (names, dtypes, shapes, group name,
  ``weight_version``) to every server -- each answers once it has received and loaded the bucket -- then
  broadcasts the bucket's tensors in that order, then waits for every answer. The bucket is released only
  after all servers answered;
- each tensor passes the shared gate (``rollout.gate``: the model's names and shapes, each once) before
  it is broadcast; after the sync every stage's names are gathered and checked for completeness;
- every bucket goes with ``flush_cache=False``, as slime's do (SGLang's default flushes after each
  bucket, and one stage's last bucket is not the sync's: other stages may still be sending). Once all
  stages are done, global rank 0 posts ``/flush_cache`` to every server, once per sync: cached prefixes
  hold KV and routed experts computed by the old weights. slime flushes just before its buckets, inside
  ``pause_generation``; here nothing generates during a sync (it runs between rollouts), and flushing
  after the last bucket leaves no window in which a request could refill the cache from old weights.

``BroadcastSync`` is the ``WeightSync`` strategy (``weights.weight_sync``): it owns each sender's
``StageBroadcaster``, its generation and the manifest. The group is rebuilt (a new generation) after a
failed sync or a server restart: a restarted server knows no group. Tensors are on the runtime's
device (NCCL on GPU); the tests run the same protocol on gloo against the
stand-in server.
"""

from __future__ import annotations

import contextlib
import datetime
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from srpo_megatron.buckets import bucketize_pending
from srpo_megatron.conversion.fp8_layout import Fp8Layout
from srpo_megatron.conversion.table import ConversionTable
from srpo_megatron.parallel import ParallelGroups
from srpo_megatron.ports import free_port
from srpo_megatron.rollout.base import EngineError
from srpo_megatron.rollout.gate import head, missing_names, validated_stream
from srpo_megatron.rollout.placement import EngineLayout
from srpo_megatron.rollout.served_precision import served_folder, served_fp8_layout
from srpo_megatron.rollout.sglang.protocol import (
    build_init_weights_update_group_request,
    build_update_weights_from_distributed_request,
    parse_update_response,
)
from srpo_megatron.weights.export import is_stage_sender, iter_stage_params
from srpo_megatron.weights.fp8_sync import quantize_pending
from srpo_megatron.weights.fused_experts import fuse_expert_slices
from srpo_megatron.weights.p2p import DEFAULT_BUCKET_BYTES
from srpo_megatron.weights.sync_common import served_manifest


def init_weights_group(
    backend: str,
    master_address: str,
    master_port: int,
    world_size: int,
    rank: int,
    group_name: str,
    timeout_s: float = 1800.0,
) -> dist.ProcessGroup:
    """A process group outside the job's default world that meets SGLang's ``init_custom_process_group``
    (the servers' side) on the same store keys: one TCP store hosted by rank 0, prefixed with the group
    name, then torch's group helper. Rank 0 hosts the store.

    The store is built here, not by ``rendezvous("tcp://...")``: under torchrun every worker has
    ``TORCHELASTIC_USE_AGENT_STORE`` set, and the tcp:// handler then makes *every* rank a client of a
    store it assumes torchrun's agent hosts, so rank 0 never listens and the servers time out."""
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world

    timeout = datetime.timedelta(seconds=timeout_s)
    # The same arguments torch's tcp:// handler gives a store outside torchrun (multi_tenant included).
    store = dist.TCPStore(
        master_address, master_port, world_size, is_master=rank == 0, timeout=timeout, multi_tenant=True
    )
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), store, group_name=group_name, timeout=timeout
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}  # group rank == "global" rank
    return pg


def wire_tensor(t: torch.Tensor) -> torch.Tensor:
    """What goes into the broadcast: ``t`` itself, except FP8 off CUDA, as its bytes (gloo has no float8
    type; NCCL broadcasts float8 as SGLang's receiving side allocates it: CUDA tensors go as they are)."""
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and t.device.type != "cuda":
        return t.view(torch.uint8)
    return t


def _threads(fns: list[Callable[[], Any]]) -> list[threading.Thread]:
    errors: list[BaseException | None] = [None] * len(fns)

    def run(i: int) -> None:
        try:
            fns[i]()
        except BaseException as e:  # reported by the joiner
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    threads.append(errors)  # type: ignore[arg-type]
    return threads


def _join(threads: list[Any], what: str, urls: list[str]) -> None:
    errors = threads.pop()
    for t in threads:
        t.join()
    bad = [f"{urls[i]}: {e}" for i, e in enumerate(errors) if e is not None]
    if bad:
        raise EngineError(f"{what} failed on " + "; ".join(bad))


class StageBroadcaster:
    """The sender side of one PP stage: its group with every server, and the per-bucket protocol.

    ``transports[k]``: an object with ``call(method, body)`` reaching server ``k`` (``HttpTransport``);
    ``tp_sizes[k]``: its TP size (ranks it contributes to the group)."""

    def __init__(
        self,
        transports: list[Any],
        urls: list[str],
        tp_sizes: list[int],
        group_name: str,
        backend: str,
        master_address: str,
        device: torch.device | str = "cpu",
        timeout_s: float = 600.0,
    ) -> None:
        """Create the group: ask every server to join (in threads: each blocks until all joined), join as
        rank 0 (in a thread too). Whichever ends first decides: a server that answers its join with an
        error ends the wait at once (EngineError naming it; our side of the rendezvous is abandoned and
        its group, should it still form, destroyed), else our rendezvous' end, bounded by ``timeout_s``;
        after a failed rendezvous a server's own error beats our timeout in the message."""
        self.transports, self.urls, self.group_name = transports, urls, group_name
        self.device = torch.device(device)
        offsets = [1 + sum(tp_sizes[:k]) for k in range(len(tp_sizes))]
        world = 1 + sum(tp_sizes)
        port = free_port()
        bodies = [
            build_init_weights_update_group_request(master_address, port, off, world, group_name, backend)
            for off in offsets
        ]
        settled = threading.Event()  # our rendezvous ended, or a server failed to join
        lock = threading.Lock()
        ours: dict[str, Any] = {"abandoned": False}

        def server_joins(transport: Any, body: dict[str, Any]) -> None:
            try:
                parse_update_response(transport.call("init_weights_update_group", body), "init group")
            except BaseException:
                settled.set()
                raise

        def we_join() -> None:
            # The servers block in their side of the rendezvous until this rank (the store's host) joins.
            try:
                group = init_weights_group(backend, master_address, port, world, 0, group_name, timeout_s)
                with lock:
                    ours["group"] = group
                    if ours["abandoned"]:  # formed after a server's failure was already reported
                        dist.destroy_process_group(ours.pop("group"))
            except BaseException as e:
                ours["error"] = e
            finally:
                settled.set()

        waiting = _threads(
            [(lambda t=t, b=b: server_joins(t, b)) for t, b in zip(transports, bodies, strict=True)]
        )
        server_errors = waiting[-1]  # _threads' per-server error slots, filled as each thread ends
        threading.Thread(target=we_join, daemon=True, name=f"{group_name}-rendezvous").start()
        settled.wait()
        failed = [f"{urls[i]}: {e}" for i, e in enumerate(list(server_errors)) if e is not None]
        if failed:  # do not wait out the rendezvous (timeout_s) for a server that will never join
            with lock:
                ours["abandoned"] = True
                group = ours.pop("group", None)
            if group is not None:
                dist.destroy_process_group(group)
            raise EngineError("init_weights_update_group failed on " + "; ".join(failed))
        try:
            if "error" in ours:
                raise ours["error"]
            self.group = ours["group"]
        finally:
            _join(waiting, "init_weights_update_group", urls)  # a server's own error beats our timeout

    def send_bucket(self, bucket: list[tuple[str, torch.Tensor]], version: int) -> None:
        """Post the bucket's metadata to every server, broadcast its tensors, wait for every answer."""
        body = build_update_weights_from_distributed_request(bucket, self.group_name, False, version)
        waiting = _threads(
            [
                (
                    lambda t=t: parse_update_response(
                        t.call("update_weights_from_distributed", body), "update_weights_from_distributed"
                    )
                )
                for t in self.transports
            ]
        )
        for _, tensor in bucket:  # the servers receive in the order of ``names``
            dist.broadcast(wire_tensor(tensor.to(self.device).contiguous()), src=0, group=self.group)
        _join(waiting, "update_weights_from_distributed", self.urls)

    def flush_cache(self) -> None:
        """``/flush_cache`` on every server: their radix caches hold KV (and routed experts) that the old
        weights computed. SGLang refuses (HTTP 400) while requests run; none do during a sync."""
        waiting = _threads([(lambda t=t: t.call("flush_cache", {})) for t in self.transports])
        _join(waiting, "flush_cache", self.urls)

    def close(self) -> None:
        for t in self.transports:
            with contextlib.suppress(Exception):  # a dead server has no group left anyway
                t.call("destroy_weights_update_group", {"group_name": self.group_name})
        dist.destroy_process_group(self.group)


def broadcast_sync(
    model: torch.nn.Module,
    table: ConversionTable,
    groups: ParallelGroups,
    broadcaster: StageBroadcaster | None,
    manifest: dict[str, tuple[int, ...]],
    version: int,
    *,
    aliases: frozenset[str] = frozenset(),
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    dtype: torch.dtype | None = None,
    fp8: Fp8Layout | None = None,
) -> str:
    """Collective over the trainer ranks: every stage streams its parameters into every server through its
    sender's ``broadcaster`` (None off the senders). Returns an error message ("" on success), the same on
    every rank, so the caller restarts and retries everywhere alike."""
    seen: set[str] = set()
    error = ""
    pending = fuse_expert_slices(iter_stage_params(model, table, groups, dtype), table)  # SGLang: whole x
    pending = quantize_pending(pending, fp8)  # an FP8 engine: weight (e4m3) + weight_scale_inv
    if not is_stage_sender(groups):
        for p in pending:  # join this stage's TP gathers
            p.fetch()
    elif broadcaster is None:
        error = f"rank {dist.get_rank()} sends stage {groups.pp_rank} but has no broadcast group"
    if is_stage_sender(groups):
        for bucket in bucketize_pending(pending, bucket_bytes):
            if error:
                continue  # after a failure keep joining the TP gathers, so the other ranks complete
            try:
                checked = list(validated_stream(bucket, manifest, seen, aliases))  # before it leaves
                broadcaster.send_bucket(checked, version)
            except EngineError as e:
                error = f"stage {groups.pp_rank}: {e}"
            del bucket  # released only after every server answered
    # Agree on the outcome and on completeness (each stage saw only its own names).
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (error, sorted(seen)), group=groups.host)
    errors = sorted({e for e, _ in everyone if e})
    if errors:
        return "; ".join(errors)
    sent = {n for _, names in everyone for n in names}
    missing = missing_names(manifest, sent)
    if missing:
        return f"weight sync to version {version} is missing {len(missing)} tensors: {head(missing)}"
    # Every stage's last bucket is in (the gather above): one flush per sync, from global rank 0 (stage
    # 0's sender). Each bucket went with flush_cache=False, so nothing flushed a cache in between.
    flushed = [""]
    if dist.get_rank() == 0:
        try:
            broadcaster.flush_cache()
        except EngineError as e:
            flushed[0] = f"after the weight sync to version {version}: {e}"
    dist.broadcast_object_list(flushed, src=0, group=groups.host)
    return flushed[0]


class BroadcastSync:
    """``WeightSync`` for separately placed servers (``rollout.sglang.weight_sync: distributed``): each stage
    sender's ``StageBroadcaster`` (built at the first push, rebuilt as ``srpo-pp{stage}-g{generation}``
    after a failure or a restart), the served manifest, and ``broadcast_sync``. One group spans every
    server, so a failure fails every engine and a push always goes to all of them."""

    def __init__(self, cfg: Any, policy: Any, groups: ParallelGroups, layout: EngineLayout, urls: list[str]):
        self.cfg, self.policy, self.groups, self.layout, self.urls = cfg, policy, groups, layout, urls
        self.broadcaster: StageBroadcaster | None = None  # on the stage senders, once connected
        self.generation = 0
        self._manifest: tuple[dict[str, tuple[int, ...]], frozenset[str]] | None = None
        self._fp8: Fp8Layout | None = None  # the served blockwise FP8 layout, read with the manifest

    def _connect(self) -> str:
        """On a stage sender without a group: build this generation's group with every server ("" or why
        it failed)."""
        from srpo_megatron.rollout.sglang.protocol import server_tp_size
        from srpo_megatron.rollout.sglang.transports import HttpTransport
        from srpo_megatron.weights.sync_address import sync_address

        sglang = self.cfg.rollout.sglang
        try:
            transports = [HttpTransport(u, sglang.request_timeout_s) for u in self.urls]
            self.broadcaster = StageBroadcaster(
                transports,
                self.urls,
                [server_tp_size(t, sglang.tp_size) for t in transports],
                f"srpo-pp{self.groups.pp_rank}-g{self.generation}",
                "nccl" if self.groups.device.type == "cuda" else "gloo",
                sync_address(self.urls),
                self.groups.device,
            )
        except EngineError as e:
            return str(e)
        return ""

    def push(self, engine: Any, version: int, targets: list[int] | None) -> dict[int, str]:
        if self._manifest is None:  # every rank: all of them check completeness against it
            self._manifest = served_manifest(self.cfg)
            self._fp8 = served_fp8_layout(served_folder(self.cfg))
        manifest, aliases = self._manifest
        error = self._connect() if is_stage_sender(self.groups) and self.broadcaster is None else ""
        everyone: list[Any] = [None] * self.layout.world_size
        dist.all_gather_object(everyone, error, group=self.groups.host)
        error = "; ".join(e for e in everyone if e)
        if not error:
            error = broadcast_sync(
                self.policy.model,
                self.policy.table,
                self.groups,
                self.broadcaster,
                manifest,
                version,
                aliases=aliases,
                bucket_bytes=self.cfg.rollout.sglang.bucket_bytes,
                fp8=self._fp8,
            )
        if error:
            self._disconnect()  # the next try builds a fresh group (a new generation)
            return dict.fromkeys(range(self.layout.num_engines), f"broadcast weight sync failed: {error}")
        if engine is not None:
            engine.adopt_version(version)
        return {}

    def _disconnect(self) -> None:
        if self.broadcaster is not None:
            with contextlib.suppress(Exception):
                self.broadcaster.close()
            self.broadcaster = None
        self.generation += 1

    def engines_restarted(self, engines: list[int]) -> None:
        self._disconnect()  # every stage builds a new group at the next push

    def close(self) -> None:
        if self.broadcaster is not None:
            with contextlib.suppress(Exception):
                self.broadcaster.close()
            self.broadcaster = None
