"""method §1 steps 1–4: rollouts, rewards, routing and the teacher's context, as one ``RolloutBatch``.

Rollouts run data-parallel over every engine (``RolloutService``), in rounds dispatched to the engines'
workers (``trainer/collect/off_policy.py``: inline on-policy, a thread per engine host off-policy); each
engine
host sends its completions of a round to global rank 0 only (``batch_shipping.gather_to_rank0``), rank 0
rewards them into its ``SamplePool`` (``trainer/collect/sample_pool.py``: dynamic sampling, staleness) and
routes a batch from it (``sample_routing.route_groups``: every ``Sample`` built once, frozen), and
``batch_shipping.ship_shares`` sends each trainer rank its data-parallel share of the samples once, MoE
routed experts included, with the batch's metrics. Routing and advantages are decided on rank 0 alone,
so all ranks agree on them.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from srpo_megatron.data.dataset import Prompt
from srpo_megatron.rewards.pool import RewardPool
from srpo_megatron.rollout.base import Completion, EngineError
from srpo_megatron.rollout.multi_turn import multi_turn_rollout
from srpo_megatron.rollout.partial import continue_partial
from srpo_megatron.rollout.placement import EngineLayout, engine_urls, separate_layout, split_prompts
from srpo_megatron.trainer.collect.batch_shipping import broadcast_from_rank0, gather_to_rank0, ship_shares
from srpo_megatron.trainer.collect.off_policy import GenerationWorker, Job
from srpo_megatron.trainer.collect.reward_errors import RewardsFailed
from srpo_megatron.trainer.collect.sample_pool import SamplePool, groups_of
from srpo_megatron.trainer.collect.sample_routing import (  # noqa: F401  (re-exported for tools/)
    clean_solution,
    sampling_params,
    teacher_prompt_ids,
)
from srpo_megatron.trainer.observe.metrics import SampleLog
from srpo_megatron.trainer.state.offload import Offloader
from srpo_megatron.trainer.step_types import METRICS, RolloutBatch, merge_metrics, reduce_values
from srpo_megatron.weights.weight_sync import build_weight_sync


@dataclass
class Dispatch:
    """One dispatched round of prompts (known to every rank: each engine host generates its share)."""

    id: int  # run-unique; seeds the round's sampling (``run.seed · 1_000_003 + id``)
    prompts: list[Prompt]

    def shares(self, num_engines: int) -> list[range]:
        return split_prompts(len(self.prompts), num_engines)


@dataclass
class EngineShare:
    """What one engine produced for one round (sent from its host to rank 0 only)."""

    engine: int
    dispatch: int
    prompts: range  # the round's prompt indices it served
    completions: list[list[Completion]] | None = None  # [prompt][sample], None on failure
    seconds: float = 0.0
    error: str = ""
    aborted: int = 0  # generations aborted by a sync and continued (partial rollouts)


class RolloutService:
    """The rollout side of the SPMD job: one engine per group of ``rollout.gpus_per_engine`` ranks (or per
    separate SGLang server).

    - ``sync(version)`` (collective) pushes the policy through the recipe's ``WeightSync`` strategy
      (``weights.weight_sync``: colocated, broadcast or disk) and checks that every engine then serves
      ``version``; with off-policy rollouts it lands between generations (``off_policy.GenerationWorker``);
    - ``next_batch`` (collective) dispatches rounds of prompts to the engines (split across them,
      balanced, a prompt's G samples on one engine, per-sample seeds from the round and the prompt's index
      in it: results do not depend on the number of engines), keeps up to ``rollout.off_policy_steps``
      rounds in flight ahead of the trainer, receives completed rounds on rank 0 only, rewards them there
      and returns each rank its DP share of a routed batch of ``prompts_per_step`` groups;
    - a failed engine is restarted alone (shut down, rebuilt on its host, resynced to the current version)
      and its prompts retried; a second failure stops the job naming the engine, its ranks and the version.
    """

    def __init__(self, cfg: Any, tokenizer: Any, policy: Any, groups: Any) -> None:
        self.cfg, self.tokenizer, self.policy, self.groups = cfg, tokenizer, policy, groups
        dist_on = dist.is_initialized()
        self.rank = dist.get_rank() if dist_on else 0
        world = dist.get_world_size() if dist_on else 1
        self.host_group = groups.host  # gloo: engine shares and the batch are host objects
        self.separate = cfg.rollout.placement == "separate"
        self.urls = engine_urls(cfg.rollout) if self.separate else []
        if self.separate:
            self.layout = separate_layout(world, len(self.urls))
        else:
            size = cfg.rollout.engine_size()
            if cfg.rollout.engine == "hf" and not cfg.rollout.gpus_per_engine:
                # the CPU engine has no TP size: one engine per TP x CP group (CP ranks share one replica)
                size = cfg.parallel.tp * cfg.parallel.cp
            self.layout = EngineLayout(world, min(size, world))
        # how the policy reaches the engines: chosen once from the recipe (weights/weight_sync.py)
        self.weight_sync = build_weight_sync(cfg, policy, groups, self.layout, self.urls)
        self.rank0 = self.rank == 0
        self.engine_index = self.layout.engine_of(self.rank)
        self.engine = self._build() if self.layout.is_host(self.rank) else None
        self.worker = self._worker() if self.engine is not None else None
        r = cfg.rollout
        self.rewards = (
            RewardPool(r.reward_workers, r.reward_timeout_s, import_timeout_s=r.reward_import_timeout_s)
            if self.rank0
            else None
        )
        self.pool = (
            SamplePool(tokenizer, cfg.rollout, cfg.loss, cfg.teacher, self.rewards) if self.rewards else None
        )
        self.sample_log = SampleLog(cfg.run.dir) if self.rank0 else None
        self.pending: collections.deque[Dispatch] = collections.deque()  # dispatched, not yet received
        self.next_dispatch = 0
        self._step = 0  # the step whose batch is being assembled (for messages)
        self._unreported: list[RoundFigures] = []  # received rounds not yet in a batch's metrics
        self.version = 0
        self.restarts = 0
        self.last_sync_s = 0.0
        self.waited_s = 0.0  # seconds this rank's trainer waited for rollouts (inline: generated them)

    def _worker(self) -> GenerationWorker:
        multi_turn = multi_turn_rollout(self.cfg, self.tokenizer)
        # partial rollouts: a trajectory is resumed by its driver (the aborted turn continued), a single
        # turn sample by continue_partial
        resume = continue_partial if multi_turn is None else multi_turn.continue_partial
        return GenerationWorker(
            engine=lambda: self.engine,
            threaded=self.cfg.rollout.off_policy_steps > 0,
            continue_partial=resume if self.cfg.rollout.partial else None,
            multi_turn=multi_turn,
        )

    def _release_for_training(self) -> None:
        """Colocated: the engine gives its accelerator memory to training, once per step, after the step's
        last round. Not after each round: a released engine's weights are gone (SGLang pauses them
        without a copy) and only the next full weight sync makes it serve again, so a second round of
        dynamic sampling must find it still serving. Separate engines keep their memory."""
        if self.cfg.rollout.placement == "colocated" and self.engine is not None:
            self.engine.release_memory()

    @property
    def eval_engine(self) -> Any:
        """The engine evaluation runs on: engine 0, on global rank 0 only (None elsewhere)."""
        return self.engine if self.rank0 else None

    def _build(self) -> Any:
        from srpo_megatron.rollout.factory import build_engine

        local = int(os.environ.get("LOCAL_RANK", "0"))
        return build_engine(
            self.cfg.rollout,
            self.cfg.model.hf_dir,
            engine_index=self.engine_index,
            base_gpu_id=local,
            urls=self.urls or None,
        )

    def _describe(self, k: int) -> str:
        ranks = self.layout.ranks_of(k)
        return f"engine {k} (trainer ranks / GPUs {ranks[0]}-{ranks[-1]}, weights v{self.version})"

    def engine_versions(self) -> list[int | None]:
        """Collective: the version each engine serves, in engine order (gathered to every rank)."""
        mine = self.engine.weight_version if self.engine is not None else None
        everyone: list[Any] = [None] * self.layout.world_size
        if self.layout.world_size > 1:
            dist.all_gather_object(everyone, mine, group=self.host_group)
        else:
            everyone = [mine]
        return [everyone[h] for h in self.layout.hosts]

    def _check_versions(self) -> None:
        versions = self.engine_versions()
        stale = [(k, v) for k, v in enumerate(versions) if v != self.version]
        if stale:
            raise EngineError(
                "engines disagree on the weight version at the start of a rollout: "
                + ", ".join(f"{self._describe(k)} serves v{v}" for k, v in stale)
            )

    def _quiesced(self) -> contextlib.AbstractContextManager[None]:
        """No generation runs on this host's engine inside the block (a sync, a restart)."""
        if self.worker is None:
            return contextlib.nullcontext()
        return self.worker.quiesced()

    def sync(self, version: int, targets: list[int] | None = None) -> float:
        """Collective: install the policy into the engines (all, or ``targets``) as ``version``; returns the
        seconds taken. An engine that fails the update is restarted alone and resynced; a second failure
        stops the job. Every engine serves ``version`` afterwards (checked). Off-policy: the sync waits for
        the running generation to end (``rollout.partial``: aborts it, continued after the sync)."""
        t0 = time.monotonic()
        with self._quiesced():
            self.waited_s += time.monotonic() - t0
            failed = self._sync_once(version, targets)
            if failed:
                self._restart(failed, f"failed the weight sync to v{version}")
                again = self._sync_once(version, failed)
                if again:
                    raise EngineError(
                        "; ".join(
                            f"{self._describe(k)} failed the weight sync again after a restart" for k in again
                        )
                    )
            self.version = version
        self._check_versions()
        self.last_sync_s = time.monotonic() - t0
        return self.last_sync_s

    def _sync_once(self, version: int, targets: list[int] | None) -> list[int]:
        """One collective push through the strategy; returns the engines whose update failed (agreed on
        every rank)."""
        failed = self.weight_sync.push(self.engine, version, targets)
        for k in sorted(failed) if self.rank0 else []:
            print(f"[srpo] {self._describe(k)} rejected weights v{version}: {failed[k]}", flush=True)
        return sorted(failed)

    def _restart(self, failed: list[int], why: str) -> None:
        """Rebuild the failed engines on their hosts (the others keep serving)."""
        for k in failed if self.rank0 else []:
            print(f"[srpo] {self._describe(k)} {why}; restarting it alone and resyncing", flush=True)
        self.weight_sync.engines_restarted(failed)  # e.g. a restarted server knows no weights group
        if self.engine_index in failed and self.engine is not None:
            with contextlib.suppress(Exception):  # the engine is already broken
                self.engine.shutdown()
            self.engine = self._build()
        self.restarts += len(failed)

    # ---------------------------------------------------------------------------------- dispatching

    def _job(self, d: Dispatch) -> Job:
        share = d.shares(self.layout.num_engines)[self.engine_index]
        seed = self.cfg.run.seed * 1_000_003 + d.id
        return Job(
            d.id,
            [list(d.prompts[i].ids) for i in share],
            sampling_params(self.cfg.rollout, seed, prompt_offset=share.start),
            rows=[d.prompts[i].row for i in share],
        )

    def _dispatch(self, prompts: list[Prompt], round_id: int | None = None) -> None:
        """Every rank: a new round of ``prompts`` (numbered ``round_id``, default the next); each engine
        host queues its share on its worker (inline workers generate it now)."""
        d = Dispatch(self.next_dispatch if round_id is None else round_id, prompts)
        self.next_dispatch = max(self.next_dispatch, d.id) + 1
        self.pending.append(d)
        if self.worker is not None:
            t0 = time.monotonic()
            self.worker.submit(self._job(d))
            if not self.worker.threaded:
                self.waited_s += time.monotonic() - t0

    def _share_of(self, d: Dispatch, engines: set[int]) -> EngineShare | None:
        """On an engine host whose engine is in ``engines``: its finished share of round ``d``."""
        k = self.engine_index
        if self.worker is None or k not in engines:
            return None
        t0 = time.monotonic()
        r = self.worker.wait(d.id)
        self.waited_s += time.monotonic() - t0
        share = EngineShare(k, d.id, d.shares(self.layout.num_engines)[k], r.completions, r.seconds)
        share.aborted = r.aborted
        if r.error:
            share.error = f"{self._describe(k)} failed at step {self._step + 1} (round {d.id}): {r.error}"
            share.completions = None
        return share

    def _gather_shares(self, share: EngineShare | None) -> dict[int, EngineShare]:
        """Collective: the engine hosts' shares on rank 0, by engine ({} elsewhere)."""
        everyone = gather_to_rank0(share, self.host_group)
        return {s.engine: s for s in everyone or [] if s is not None}

    def _failures(self, shares: dict[int, EngineShare]) -> list[tuple[int, str]]:
        """Collective: the engines whose share failed and why, from rank 0 to every rank (which then
        restart them, resync and regenerate together)."""
        failed = [(k, s.error) for k, s in sorted(shares.items()) if s.error] if self.rank0 else None
        return broadcast_from_rank0(failed, self.host_group)

    def _receive(self, d: Dispatch) -> None:
        """Collective: round ``d``'s completions on rank 0, into the pool; failed engines are restarted,
        resynced and their share generated again (with the current weights)."""
        all_engines = set(range(self.layout.num_engines))
        shares = self._gather_shares(self._share_of(d, all_engines))
        failed = self._failures(shares)
        if failed:
            for _, error in failed if self.rank0 else []:
                print(f"[srpo] {error}", flush=True)
            engines = [k for k, _ in failed]
            with self._quiesced():
                self._restart(engines, f"failed at step {self._step + 1} (round {d.id})")
            self.sync(self.version, targets=engines)
            if self.worker is not None and self.engine_index in engines:
                self.worker.submit(self._job(d))
            retried = self._gather_shares(self._share_of(d, set(engines)))
            again = self._failures(retried)
            if again:
                raise EngineError(
                    "; ".join(f"{error} (again after a restart; giving up)" for _, error in again)
                )
            shares.update(retried)
        if self.rank0:
            assert self.pool is not None
            completions = [c for k in sorted(shares) for c in shares[k].completions]
            self.pool.add_round(groups_of(d.id, d.prompts, completions))
            self._unreported.extend(RoundFigures.of(shares[k]) for k in sorted(shares))

    def _decide(self, n: int, trainer_version: int, t_gen: float) -> tuple[bool, RolloutBatch | None]:
        """Collective: rank 0 tries to take a batch from the pool; every rank learns whether it did
        (rank 0 gets the batch itself)."""
        batch, failed = None, None
        if self.rank0:
            assert self.pool is not None
            r = self.cfg.rollout
            try:
                batch = self.pool.take(n, trainer_version, r.off_policy_steps, t_gen, step=self._step + 1)
            except RewardsFailed as e:  # every rank stops with rank 0's line
                failed = str(e)
        verdict = (batch is not None, failed) if self.rank0 else None
        ready, failed = broadcast_from_rank0(verdict, self.host_group)
        if failed:
            raise RewardsFailed(failed)
        return ready, batch

    def _pooled(self) -> int:
        """Collective: the groups rank 0's pool holds (every rank)."""
        return broadcast_from_rank0(len(self.pool) if self.rank0 else None, self.host_group)

    def next_batch(
        self,
        draw: Callable[[int], list[Prompt]],
        step: int,
        trainer_version: int,
        prompts_per_batch: int | None = None,
        round_id: int | None = None,
    ) -> RolloutBatch:
        """Collective: this rank's DP share of the routed batch that trains step ``step`` (method §1 steps
        1–4), and the batch's metrics. ``draw(n)`` gives the next ``n`` prompts of the data order (every
        rank draws the same). Up to ``rollout.off_policy_steps`` rounds beyond this step's stay in flight
        on the engines; a sample staler than that bound is dropped (counted), never trained. A batch (and a
        round) holds ``prompts_per_batch`` groups, default ``rollout.prompts_per_step``; ``round_id``
        numbers the first round dispatched (its sampling seed), default the next round."""
        self._check_versions()
        self._step = step
        r = self.cfg.rollout
        b = prompts_per_batch or r.prompts_per_step
        pending = lambda: sum(len(d.prompts) for d in self.pending)  # noqa: E731
        supply = self._pooled() + pending()
        while supply < (r.off_policy_steps + 1) * b:  # keep N rounds in flight beyond this step's
            self._dispatch(draw(b), round_id)
            round_id, supply = None, supply + b
        while True:
            ready, batch = self._decide(b, trainer_version, _generation_seconds(self._unreported))
            if ready:
                break
            if not self.pending:
                self._dispatch(draw(b))
            self._receive(self.pending.popleft())
        self._release_for_training()  # every round of the step is in: training takes the memory
        if self.rank0:
            assert batch is not None
            batch.metrics = merge_metrics(batch.metrics, engine_metrics(self._unreported, self.last_sync_s))
            assert self.sample_log is not None
            self.sample_log.log(step + 1, trainer_version, batch.samples)
            self._unreported = []
        g = self.groups
        return ship_shares(
            batch,
            dp_rank=g.dp_rank,
            dp_size=g.dp_size,
            mini_batches=self.cfg.train.mini_batches,
            group=self.host_group,
        )

    def collect(self, prompts: list[Prompt], step: int) -> RolloutBatch:
        """Collective: one round of exactly ``prompts``, routed (the on-policy step; tests and tools). The
        round is numbered ``step``, so its sampling seed is the step's, as in the synchronous loop."""
        given = [prompts]
        return self.next_batch(lambda n: given.pop(), step, self.version, len(prompts), round_id=step)

    def drain(self) -> None:
        """Collective: receive every dispatched round into rank 0's pool (before a checkpoint: the pool
        is saved with it; nothing is then in flight, and a resume draws the next rounds from the saved
        data cursor exactly as the uninterrupted run does)."""
        while self.pending:
            self._receive(self.pending.popleft())

    def buffer_state(self) -> dict | None:
        """Collective: receive every round in flight (``drain``), then rank 0's pool state for the checkpoint
        (None elsewhere)."""
        self.drain()
        if self.pool is None:
            return None
        return {
            "pool": self.pool.state_dict(),
            "rounds": [dataclasses.asdict(f) for f in self._unreported],  # reported with the next batch
        }

    def load_buffer_state(self, next_dispatch: int, state: dict | None) -> None:
        """After a resume: the next round's number and (rank 0) the pool's saved rollouts, trained next."""
        self.next_dispatch = next_dispatch
        if self.pool is not None and state is not None:
            self.pool.load_state_dict(state["pool"])
            self._unreported = [RoundFigures(**f) for f in state["rounds"]]

    def idle_metrics(self, since: float) -> dict[str, float]:
        """Collective: ``async/engine_idle_share`` (mean over engines of the share of ``[since, now]`` their
        engine was not generating) and ``async/trainer_idle_share`` (rank 0's waits for rollouts)."""
        now = time.monotonic()
        span = max(now - since, 1e-9)
        mine = None if self.worker is None else self.worker.busy_seconds(since, now) / span
        busy = [b for b in gather_to_rank0(mine, self.host_group) or [] if b is not None]
        waited, self.waited_s = self.waited_s, 0.0
        if not self.rank0:
            return {}
        return {
            "async/engine_idle_share": 1.0 - sum(min(b, 1.0) for b in busy) / max(len(busy), 1),
            "async/trainer_idle_share": min(waited / span, 1.0),
        }

    @contextlib.contextmanager
    def offloaded_for_save(self, offloader: Offloader, version: int) -> Iterator[None]:
        """The trainer's state on the device for a checkpoint save, after the weight sync of ``version``.

        With the colocated offload every engine holds its weights and KV cache then, so each engine
        releases its memory for the save (on its host rank: every rank group's GPUs reach the trainer's
        peak) and all are resumed and re-synced to the same ``version`` afterwards (one extra weight sync
        per checkpoint) instead of sharing the GPUs at the trainer's peak."""
        if not offloader.away or self.cfg.rollout.placement != "colocated":
            with offloader.all_on_device():
                yield
            return
        if self.engine is not None:  # each engine host: one engine per rank group
            self.engine.release_memory()
        with offloader.all_on_device():
            yield
        offloader.before_rollouts()  # all_on_device restored it; explicit for the engine's resume below
        self.sync(version)

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
        self.weight_sync.close()
        if self.rewards is not None:
            self.rewards.close()
        if self.engine is not None:
            self.engine.shutdown()


@dataclass(frozen=True)
class RoundFigures:
    """One engine's figures for one received round (what ``engine_metrics`` reports; saved with the pool)."""

    engine: int
    dispatch: int
    samples: int
    tokens: int
    seconds: float
    aborted: int = 0  # generations a sync aborted and that were continued with newer weights

    @classmethod
    def of(cls, share: EngineShare) -> RoundFigures:
        groups = share.completions or []
        return cls(
            share.engine,
            share.dispatch,
            sum(len(g) for g in groups),
            sum(len(c.token_ids) for g in groups for c in g),
            share.seconds,
            share.aborted,
        )


def _generation_seconds(figures: list[RoundFigures]) -> float:
    """Generation seconds of the received rounds: per round the slowest engine's, summed over rounds."""
    rounds: dict[int, float] = {}
    for f in figures:
        rounds[f.dispatch] = max(rounds.get(f.dispatch, 0.0), f.seconds)
    return sum(rounds.values())


def engine_metrics(figures: list[RoundFigures], sync_s: float) -> dict[str, float]:
    """``rollout/*``: engine count, per-engine samples and response tokens (min, max), the slowest
    engine's seconds, and the last weight sync's seconds; each engine's figures summed over the rounds
    received for the batch, then reduced over engines as declared (a batch entirely from rounds already
    reported, e.g. dynamic sampling's surplus, reports no engine)."""
    if not figures:
        return {"rollout/engines": 0.0, "rollout/sync_s": sync_s, "rollout/aborted": 0.0}
    engines = sorted({f.engine for f in figures})
    mine = {k: [f for f in figures if f.engine == k] for k in engines}
    per_engine = {
        "rollout/samples_per_engine_min": [sum(f.samples for f in mine[k]) for k in engines],
        "rollout/samples_per_engine_max": [sum(f.samples for f in mine[k]) for k in engines],
        "rollout/response_tokens_per_engine_min": [sum(f.tokens for f in mine[k]) for k in engines],
        "rollout/response_tokens_per_engine_max": [sum(f.tokens for f in mine[k]) for k in engines],
        "rollout/engine_seconds_max": [sum(f.seconds for f in mine[k]) for k in engines],
    }
    out = {"rollout/engines": float(len(engines))}
    out.update({name: reduce_values(METRICS[name].reduce, values) for name, values in per_engine.items()})
    out["rollout/sync_s"] = sync_s
    out["rollout/aborted"] = float(sum(f.aborted for f in figures))
    return out
