"""``srpo train``: the SRPO loop (SPEC §1), one step = generate → reward → route → score → train → EMA → sync.

The torchrun (SPMD) job is the controller: global rank 0 hosts the rollout engine (CPU transformers
engine, or a client of SGLang engines), scores rewards and broadcasts the routed batch; every rank then
runs the Megatron scoring and training passes on its data-parallel share. Resumes from
``<run.dir>/checkpoints/latest`` automatically.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch.distributed as dist

from srpo_megatron.configs import load_config, to_dict
from srpo_megatron.data.dataset import EpochSampler, build_datasets
from srpo_megatron.parallel import destroy_model_parallel, initialize_model_parallel
from srpo_megatron.rewards import register_reward
from srpo_megatron.rewards.pool import RewardPool
from srpo_megatron.rollout.factory import build_engine, load_tokenizer
from srpo_megatron.trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from srpo_megatron.trainer.config import TrainConfig
from srpo_megatron.trainer.evaluation import evaluate_policy
from srpo_megatron.trainer.metrics import MetricsLogger
from srpo_megatron.trainer.policy_runtime import PolicyRuntime
from srpo_megatron.trainer.rollouts import broadcast_batch, collect_rollouts
from srpo_megatron.trainer.step_metrics import step_metrics
from srpo_megatron.weights.sync import sync_in_process


def train(cfg: TrainConfig) -> dict:
    wall0 = time.monotonic()
    groups = initialize_model_parallel(cfg.parallel.tp, cfg.parallel.pp, seed=cfg.run.seed)
    rank0 = dist.get_rank() == 0
    for kind, target in cfg.rollout.reward_fns.items():
        register_reward(kind, target)
    run_dir = Path(cfg.run.dir)
    tokenizer = load_tokenizer(cfg.model.hf_dir)
    train_set, _ = build_datasets(cfg.data, tokenizer)
    sampler = EpochSampler(len(train_set), cfg.data.seed, cfg.data.shuffle)
    runtime = PolicyRuntime(cfg, groups)
    engine = build_engine(cfg.rollout, cfg.model) if rank0 else None
    rewards = RewardPool(cfg.rollout.reward_workers, cfg.rollout.reward_timeout_s) if rank0 else None
    # Version 1 = the starting weights; each optimizer step's sync carries the next version.
    step, version, history = 0, 1, {"evals": []}
    if (ckpt := latest_checkpoint(run_dir)) is not None:
        state = load_checkpoint(runtime, ckpt)
        step, version, history = state["step"], state["weight_version"], state["history"]
        sampler.load_state_dict(state["sampler"])
    sync_in_process(runtime.model, runtime.table, groups, engine, version)  # engine == trainer weights
    if rank0:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(_yaml(to_dict(cfg)))
    logger = (
        MetricsLogger(
            run_dir,
            tensorboard=cfg.run.tensorboard,
            wandb_project=cfg.run.wandb_project,
            progress=cfg.run.progress_bar,
            total=cfg.train.steps,
            start=step,
        )
        if rank0
        else None
    )
    if cfg.train.eval_at_ends and step == 0:
        history["evals"].append(evaluate_policy(cfg, engine, tokenizer, run_dir, step))
    sdpo_fracs: list[float] = []
    while step < cfg.train.steps:
        t0 = time.monotonic()
        prompts = [train_set[i] for i in sampler.next_indices(cfg.rollout.prompts_per_step)]
        batch = None
        if rank0:
            batch = collect_rollouts(
                engine,
                tokenizer,
                prompts,
                cfg.rollout,
                cfg.loss,
                cfg.teacher,
                rewards,
                seed=cfg.run.seed * 1_000_003 + step,
            )
        batch = broadcast_batch(batch)
        per_opt_step = []
        for mini in _split(batch.samples, cfg.train.mini_batches):
            mine = _split(mini, groups.dp_size)[groups.dp_rank]
            stored, score_info = runtime.score(mine)
            t2 = time.monotonic()
            out = runtime.train_step(mine, stored)
            out.update(score_info, train_s=time.monotonic() - t2)
            per_opt_step.append(out)
        runtime.update_teacher()
        t3 = time.monotonic()
        version += 1
        sync_in_process(runtime.model, runtime.table, groups, engine, version)
        sync_s = time.monotonic() - t3
        step += 1
        metrics = step_metrics(batch, per_opt_step, sync_s, time.monotonic() - t0)
        if rank0:
            logger.log(step, metrics)
        sdpo_fracs.append(metrics["route/sdpo_frac"])
        if cfg.eval.every_n_steps and step % cfg.eval.every_n_steps == 0 and step < cfg.train.steps:
            history["evals"].append(evaluate_policy(cfg, engine, tokenizer, run_dir, step))
        if (cfg.run.save_every and step % cfg.run.save_every == 0) or step == cfg.train.steps:
            state = {"weight_version": version, "sampler": sampler.state_dict(), "history": history}
            save_checkpoint(runtime, run_dir, step, state, cfg.run.keep_last)
    if cfg.train.eval_at_ends:
        history["evals"].append(evaluate_policy(cfg, engine, tokenizer, run_dir, step))
    if rank0:
        logger.close()
        rewards.close()
        engine.shutdown()
    destroy_model_parallel()
    evals = [e for e in history["evals"] if e]
    summary = {
        "steps": step,
        "wall_time_s": round(time.monotonic() - wall0, 1),
        "before": evals[0] if len(evals) > 1 else None,
        "after": evals[-1] if evals else None,
        "mean_sdpo_frac": sum(sdpo_fracs) / len(sdpo_fracs) if sdpo_fracs else None,
    }
    return {"rank": 0 if rank0 else 1, "summary": summary}


def _split(items: list, n: int) -> list[list]:
    if len(items) % n:
        raise ValueError(
            f"{len(items)} samples cannot be split evenly into {n} parts; make rollout.prompts_per_step × "
            "rollout.group_size divisible by train.mini_batches × data-parallel size"
        )
    k = len(items) // n
    return [items[i * k : (i + 1) * k] for i in range(n)]


def _yaml(data: dict) -> str:
    import yaml

    return yaml.safe_dump(data, sort_keys=False)


def main(recipe: str, overrides: list[str]) -> dict:
    return train(load_config(TrainConfig, recipe, overrides))
