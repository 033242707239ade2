"""``srpo train``: the SRPO loop (method §1); a step = generate → reward → route → score → train → EMA → sync.

The torchrun (SPMD) job is the controller: the engine hosts send their completions to global rank 0,
which holds the reward pool, routes the batch and ships every rank its data-parallel share once; every
rank then scores its share once (π_old, teacher) and takes ``train.mini_batches`` optimizer steps on it.
What flows between the phases is typed in ``trainer/step_types.py``. A run resumes from the newest
checkpoint of ``<run.dir>/checkpoints`` that verifies (``latest`` is a hint), refusing recipe changes the
checkpoint fixes (trainer/run/resume.py). Checkpoints must come from a trusted source.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch.distributed as dist

from srpo_megatron.children import kill_forks_with_me
from srpo_megatron.config import TrainConfig, to_dict
from srpo_megatron.data.dataset import EpochSampler, build_datasets, train_files_sha256
from srpo_megatron.parallel import destroy_model_parallel, initialize_model_parallel
from srpo_megatron.rewards import register_reward, reward_target
from srpo_megatron.rollout.factory import load_tokenizer
from srpo_megatron.trainer.collect.rollout_service import RolloutService
from srpo_megatron.trainer.observe.evaluation import BudgetClock, evaluate_policy
from srpo_megatron.trainer.observe.metrics import MetricsLogger
from srpo_megatron.trainer.observe.stats import reduce_stats
from srpo_megatron.trainer.observe.step_metrics import gather_stats, step_metrics
from srpo_megatron.trainer.observe.teacher_watch import TeacherWatch
from srpo_megatron.trainer.passes.learning import learn
from srpo_megatron.trainer.passes.scoring import scoring_pass
from srpo_megatron.trainer.run.checkpoint import (
    load_checkpoint,
    load_rollout_buffer,
    save_checkpoint,
    wait_for_pruning,
)
from srpo_megatron.trainer.run.preflight import (
    check_before_model,
    check_rewards,
    data_summary,
)
from srpo_megatron.trainer.run.resume import resume_point
from srpo_megatron.trainer.run.run_dir import claim_run_dir, release_run_dir
from srpo_megatron.trainer.run.save_guard import guarded_save
from srpo_megatron.trainer.state.policy import Policy
from srpo_megatron.trainer.step_types import TrainerState, merge_metrics


def train(cfg: TrainConfig) -> dict:
    wall0 = time.monotonic()
    kill_forks_with_me()  # megatron's forked checkpoint writers die with this process (children.py)
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    check_before_model(
        cfg, world
    )  # config.json, model limits, layout, MoE replay: before megatron or the model
    p = cfg.parallel
    groups = initialize_model_parallel(p.tp, p.pp, seed=cfg.run.seed, ep=p.ep, etp=p.etp, cp=p.cp)
    rank0 = dist.get_rank() == 0
    log = print if rank0 else (lambda _: None)
    claim_run_dir(cfg.run.dir, log)  # checked and locked (rank 0) before anything writes there
    for kind, target in cfg.rollout.reward_fns.items():
        register_reward(kind, target)
    run_dir = Path(cfg.run.dir)
    tokenizer = load_tokenizer(cfg.model.hf_dir)
    train_set, eval_set = build_datasets(cfg.data, tokenizer)
    log(data_summary(train_set, eval_set))
    kinds = {p.row.kind for ds in (train_set, eval_set) for p in ds}
    check_rewards(sorted({reward_target(k) for k in kinds}), cfg.rollout)
    # the files' SHA-256 is saved with the cursor: a file rewritten in place is refused on resume
    sampler = EpochSampler(len(train_set), cfg.data.seed, cfg.data.shuffle, train_files_sha256(cfg.data))
    ckpt = resume_point(cfg, log)  # latest is a hint; refuses changed recipes and silent restarts
    policy = Policy(cfg, groups)
    rollouts = RolloutService(cfg, tokenizer, policy, groups)
    st = TrainerState()  # weight version 1 = the starting weights; each step's sync carries the next one
    if ckpt is not None:
        log(f"resuming from {ckpt}")
        st = TrainerState.from_checkpoint(load_checkpoint(policy, ckpt, log))
        sampler.load_state_dict(st.sampler)
        # older checkpoints dispatched one round per step; rank 0 holds the saved (untrained) rollouts
        first = st.step if st.next_dispatch is None else st.next_dispatch
        rollouts.load_buffer_state(first, load_rollout_buffer(ckpt) if rank0 else None)
    clock = BudgetClock(st.budget_clock_s)
    policy.offload.before_rollouts()  # parallel.offload_during_rollout (trainer/state/offload.py)
    rollouts.sync(st.weight_version)  # the engine serves exactly the trainer's weights from here on
    logger = MetricsLogger(run_dir, cfg.run, total=cfg.train.steps, start=st.step, log=log) if rank0 else None
    if rank0:
        (run_dir / "config.yaml").write_text(_yaml(to_dict(cfg)))
    evaluate = lambda: st.evals.append(  # noqa: E731
        evaluate_policy(cfg, rollouts.eval_engine, tokenizer, run_dir, st.step, clock)
    )
    if cfg.train.eval_at_ends and cfg.train.eval_at_start and st.step == 0:
        evaluate()
    watch = TeacherWatch(log, state=st.teacher_watch)
    draw = lambda n: [train_set[i] for i in sampler.next_indices(n)]  # noqa: E731  (same on every rank)
    while st.step < cfg.train.steps:
        t0 = time.monotonic()
        # this rank's DP share of the routed batch, and the batch's metrics; off-policy: the engines
        # keep generating the next rounds meanwhile (trainer/collect/off_policy.py)
        mine = rollouts.next_batch(draw, st.step, st.weight_version)
        rollout_memory = policy.offload.after_rollouts()  # the engine released its memory: take it back
        # π_old, top-K ids, teacher: once, before any step; tokens staler than the bound are masked there
        scored = scoring_pass(policy, mine.samples, trainer_version=st.weight_version)
        learned = learn(policy, scored, cfg.train.mini_batches)
        policy.update_teacher_after(learned)  # no EMA step when every optimizer step was skipped
        st.weight_version += 1
        version = st.weight_version
        policy.offload.before_rollouts()
        sync_s = rollouts.sync(version)
        st.step += 1
        step = st.step
        stats = gather_stats(reduce_stats([scored.stats, learned]), groups.host)
        metrics = merge_metrics(
            step_metrics(mine, stats, sync_s, time.monotonic() - t0),
            {"engine/restarts": float(rollouts.restarts)},
            rollouts.idle_metrics(t0),
            rollout_memory,
        )
        metrics = merge_metrics(metrics, watch.observe(step, metrics))  # "teacher moved?" (one warning)
        st.teacher_watch = watch.state_dict()
        st.sdpo_fracs.append(metrics["route/sdpo_frac"])
        if rank0:
            logger.log(step, metrics)
        if cfg.eval.every_n_steps and step % cfg.eval.every_n_steps == 0 and step < cfg.train.steps:
            evaluate()
        if (cfg.run.save_every and step % cfg.run.save_every == 0) or step == cfg.train.steps:
            buffered = rollouts.buffer_state()  # every round in flight received; rank 0: its pool
            st.next_dispatch = rollouts.next_dispatch
            state = st.to_checkpoint(sampler.state_dict(), clock.elapsed())
            # the offloaded state back; a save the disk cannot hold, or that fails again, stops the run
            with (
                rollouts.offloaded_for_save(policy.offload, version),
                guarded_save(run_dir, step, log, cfg.run.keep_last),
            ):
                save_checkpoint(policy, run_dir, step, state, cfg.run.keep_last, buffered)
    if cfg.train.eval_at_ends:
        evaluate()
    wait_for_pruning()  # the last save's deletions, before another trainer may take the run dir
    if rank0:
        logger.close()
        release_run_dir(cfg.run.dir)
    rollouts.close()
    destroy_model_parallel()
    return {
        "rank": dist.get_rank() if dist.is_initialized() else 0,
        "summary": _summary(st, wall0),
    }


def _summary(st: TrainerState, wall0: float) -> dict:
    evals = [e for e in st.evals if e]
    fracs = st.sdpo_fracs
    return {
        "steps": st.step,
        "wall_time_s": round(time.monotonic() - wall0, 1),
        "before": evals[0] if len(evals) > 1 else None,
        "after": evals[-1] if evals else None,
        "mean_sdpo_frac": sum(fracs) / len(fracs) if fracs else None,
    }


def _yaml(data: dict) -> str:
    import yaml

    return yaml.safe_dump(data, sort_keys=False)
