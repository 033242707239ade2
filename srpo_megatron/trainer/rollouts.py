"""method §1 steps 1–4: rollouts, rewards, routing and the teacher's context, as one ``RolloutBatch``.

Rollouts run data-parallel over every colocated engine (``RolloutService``); each engine host sends its
completions to global rank 0 only (``batch_shipping.gather_to_rank0``), rank 0 rewards and routes them
(``route_rollouts``: every ``Sample`` built once, frozen), and ``batch_shipping.ship_shares`` sends each
trainer rank its data-parallel share of the samples once, MoE routed experts included, with the batch's
metrics. Routing and advantages are decided on rank 0 alone, so all ranks agree on them.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from srpo_megatron.data.dataset import Prompt
from srpo_megatron.rewards.pool import RewardPool
from srpo_megatron.rollout.base import Completion, EngineError
from srpo_megatron.rollout.placement import EngineLayout, engine_urls, separate_layout, split_prompts
from srpo_megatron.trainer.batch_shipping import broadcast_from_rank0, gather_to_rank0, ship_shares
from srpo_megatron.trainer.offload import Offloader
from srpo_megatron.trainer.routing_batch import (  # noqa: F401  (re-exported for tools/)
    clean_solution,
    route_rollouts,
    sampling_params,
    teacher_prompt_ids,
)
from srpo_megatron.trainer.step_types import METRICS, RolloutBatch, merge_metrics, reduce_values
from srpo_megatron.weights.weight_sync import build_weight_sync


@dataclass
class EngineShare:
    """What one engine produced for a step (sent from its host to rank 0 only)."""

    engine: int
    prompts: range  # global prompt indices it served
    completions: list[list[Completion]] | None = None  # [prompt][sample], None on failure
    seconds: float = 0.0
    error: str = ""


class RolloutService:
    """The rollout side of the SPMD job: one engine per group of ``rollout.gpus_per_engine`` ranks.

    - ``sync(version)`` (collective) pushes the policy through the recipe's ``WeightSync`` strategy
      (``weights.weight_sync``: colocated, broadcast or disk) and checks that every engine then serves
      ``version``;
    - ``collect`` (collective) splits the step's prompts across the engines (balanced, a prompt's G
      samples on one engine, per-sample seeds from the global prompt index: results do not depend on
      the number of engines), checks that all engines serve the same version, gathers the completions on
      rank 0 only, rewards and routes them there, and returns each rank its DP share of the batch;
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
        r = cfg.rollout
        self.rewards = (
            RewardPool(r.reward_workers, r.reward_timeout_s, import_timeout_s=r.reward_import_timeout_s)
            if self.rank0
            else None
        )
        self.version = 0
        self.restarts = 0
        self.last_sync_s = 0.0

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

    def sync(self, version: int, targets: list[int] | None = None) -> float:
        """Collective: install the policy into the engines (all, or ``targets``) as ``version``; returns the
        seconds taken. An engine that fails the update is restarted alone and resynced; a second failure
        stops the job. Every engine serves ``version`` afterwards (checked)."""
        t0 = time.monotonic()
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

    def _generate(self, prompts: list[Prompt], step: int, engines: set[int]) -> EngineShare | None:
        """On an engine host whose engine is in ``engines``: its share of the step's rollouts."""
        k = self.engine_index
        if self.engine is None or k not in engines:
            return None
        share = EngineShare(k, split_prompts(len(prompts), self.layout.num_engines)[k])
        t0 = time.monotonic()
        seed = self.cfg.run.seed * 1_000_003 + step
        try:
            mine = [list(prompts[i].ids) for i in share.prompts]
            params = sampling_params(self.cfg.rollout, seed, prompt_offset=share.prompts.start)
            share.completions = self.engine.generate(mine, params) if mine else []
            if self.cfg.rollout.placement == "colocated":
                self.engine.release_memory()  # give the accelerator memory to training
        except EngineError as e:
            share.error = f"{self._describe(k)} failed at step {step + 1}: {e}"
            share.completions = None
        share.seconds = time.monotonic() - t0
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

    def collect(self, prompts: list[Prompt], step: int) -> RolloutBatch:
        """Collective: rollouts, rewards and routing for ``prompts`` (method §1 steps 1–4); this rank's DP
        share of the samples (``batches.rank_share``) and the whole batch's metrics."""
        self._check_versions()
        all_engines = set(range(self.layout.num_engines))
        shares = self._gather_shares(self._generate(prompts, step, all_engines))
        failed = self._failures(shares)
        if failed:
            for _, error in failed if self.rank0 else []:
                print(f"[srpo] {error}", flush=True)
            engines = [k for k, _ in failed]
            self._restart(engines, f"failed at step {step + 1}")
            self.sync(self.version, targets=engines)
            retried = self._gather_shares(self._generate(prompts, step, set(engines)))
            again = self._failures(retried)
            if again:
                raise EngineError(
                    "; ".join(f"{error} (again after a restart; giving up)" for _, error in again)
                )
            shares.update(retried)
        batch = None
        if self.rank0:
            completions = [c for k in sorted(shares) for c in shares[k].completions]
            c = self.cfg
            t_gen = max(s.seconds for s in shares.values())
            batch = route_rollouts(
                self.tokenizer, prompts, completions, c.rollout, c.loss, c.teacher, self.rewards, t_gen
            )
            batch.metrics = merge_metrics(
                batch.metrics, engine_metrics(list(shares.values()), self.last_sync_s)
            )
        g = self.groups
        return ship_shares(
            batch,
            dp_rank=g.dp_rank,
            dp_size=g.dp_size,
            mini_batches=self.cfg.train.mini_batches,
            group=self.host_group,
        )

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
        self.weight_sync.close()
        if self.rewards is not None:
            self.rewards.close()
        if self.engine is not None:
            self.engine.shutdown()


def engine_metrics(shares: list[EngineShare], sync_s: float) -> dict[str, float]:
    """``rollout/*``: engine count, per-engine samples and response tokens (min, max), the slowest
    engine's seconds, and the last weight sync's seconds; each reduced over engines as declared."""
    samples = [sum(len(g) for g in s.completions) for s in shares]
    tokens = [sum(len(c.token_ids) for g in s.completions for c in g) for s in shares]
    per_engine = {
        "rollout/samples_per_engine_min": samples,
        "rollout/samples_per_engine_max": samples,
        "rollout/response_tokens_per_engine_min": tokens,
        "rollout/response_tokens_per_engine_max": tokens,
        "rollout/engine_seconds_max": [s.seconds for s in shares],
    }
    out = {"rollout/engines": float(len(shares))}
    out.update({name: reduce_values(METRICS[name].reduce, values) for name, values in per_engine.items()})
    out["rollout/sync_s"] = sync_s
    return out
