"""avg@k evaluation through any ``RolloutEngine``: sample k responses per prompt, score them, write it all.

``evaluate`` samples ``k`` completions per prompt (paper: k = 16, temperature 0.6, top-p 0.95), decodes
them (special tokens skipped), scores each with its row's reward kind in a ``RewardPool`` and computes,
per benchmark, avg@k = mean over prompts of the mean reward of the prompt's k samples (every prompt has
exactly k samples, so this is also the mean over all samples), and the unweighted mean over benchmarks
(the paper's "average" column). It writes ``samples.jsonl`` (one line per sample: benchmark, prompt,
response, reward, ...) and ``summary.json`` into ``out_dir``.

With ``multi_turn`` (a ``rollout/multi_turn.MultiTurnRollout``, built from ``rollout.environment``) each
sample is a trajectory driven by the same code as training's rollouts: the verifier reads its assistant
turns, its reward adds the environment's per-turn parts (0 after a fault under ``on_tool_fault: fail``),
and the summary carries the ``multiturn/*`` metrics over all samples.

``run_eval`` is the entry point the CLI (``srpo eval``) and the trainer call: it builds the held-out
prompts from the recipe's ``data`` section and evaluates them; ``greedy_accuracy`` is its k = 1,
temperature 0 form.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from srpo_megatron.config import DataConfig, EvalConfig
from srpo_megatron.data.dataset import Prompt, PromptDataset, arithmetic_rows
from srpo_megatron.rewards import RewardPool
from srpo_megatron.rewards.failures import check_reward_failures
from srpo_megatron.rewards.pool import RewardResult
from srpo_megatron.rollout.base import RolloutEngine, SamplingParams
from srpo_megatron.rollout.multi_turn import Trajectory, multi_turn_metrics, multi_turn_rollout

SAMPLES_FILE = "samples.jsonl"
SUMMARY_FILE = "summary.json"


def evaluate(
    engine: RolloutEngine,
    benchmarks: Mapping[str, Sequence[Prompt]],
    tokenizer: Any,
    out_dir: str | Path,
    *,
    k: int = 16,
    temperature: float = 0.6,
    top_p: float = 0.95,
    max_new_tokens: int = 8192,
    seed: int = 1234,
    prompts_per_call: int = 64,
    reward_pool: RewardPool | None = None,
    step: int | None = None,
    allow_reward_errors: bool = False,
    multi_turn: Any | None = None,
) -> dict[str, Any]:
    """avg@k per benchmark and their mean; writes ``samples.jsonl`` and ``summary.json`` to ``out_dir``.

    Rewards that failed follow training's rule (``rewards/failures.py``): more than half of them is a
    warning; all of them is ``RewardsFailed`` (after ``samples.jsonl`` is written, before the summary),
    unless ``allow_reward_errors`` (``rollout.allow_reward_errors``)."""
    if not benchmarks or any(len(ps) == 0 for ps in benchmarks.values()):
        empty = [name for name, ps in benchmarks.items() if not ps] or ["(none given)"]
        raise ValueError(f"evaluate: no prompts for benchmark(s) {empty}; check data.eval_files")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    items = [(name, i, p) for name, ps in benchmarks.items() for i, p in enumerate(ps)]
    params = SamplingParams(
        n=k,
        temperature=temperature,
        top_p=top_p,
        max_new_tokens=max_new_tokens,
        stop_token_ids=tuple(i for i in (getattr(tokenizer, "eos_token_id", None),) if i is not None),
    )
    completions = _generate(engine, [p for _, _, p in items], params, prompts_per_call, seed, multi_turn)
    gen_s = time.monotonic() - t0
    records = _records(items, completions, tokenizer)
    scored = _score(records, reward_pool)
    for r in records:
        if "turns" in r:  # a trajectory: the environment's reward parts, or 0 after a fault under fail
            r["reward"] = 0.0 if r["tool_failed"] else r["reward"] + r["env_reward"]
    with (out / SAMPLES_FILE).open("w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    where = f"the evaluation{f' at step {step}' if step is not None else ''} ({out / SAMPLES_FILE})"
    failed = scored.num_errors + scored.num_timeouts
    check_reward_failures(
        where, len(records), failed, scored.errors, allow_reward_errors, "reports them as reward 0"
    )
    summary = {
        "k": k,
        "temperature": temperature,
        "top_p": top_p,
        "max_new_tokens": max_new_tokens,
        "seed": seed,
        "step": step,
        "weight_version": engine.weight_version,
        **_scores(benchmarks, records, k),
        **({"multi_turn": multi_turn_metrics([c for g in completions for c in g])} if multi_turn else {}),
        "reward_timeouts": scored.num_timeouts,
        "reward_errors": scored.num_errors,
        "generate_s": gen_s,
        "total_s": time.monotonic() - t0,
    }
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def _generate(
    engine: RolloutEngine,
    prompts: list[Prompt],
    params: SamplingParams,
    prompts_per_call: int,
    seed: int,
    multi_turn: Any | None = None,
) -> list[list[Any]]:
    """``params.n`` completions per prompt, ``prompts_per_call`` prompts per engine call (or per
    ``multi_turn.generate`` call: trajectories, their rows' environments answering the turns)."""
    completions = []
    for start in range(0, len(prompts), prompts_per_call):
        chunk = prompts[start : start + prompts_per_call]
        # Distinct per chunk, so prompts in different calls do not share sample seeds.
        chunk_params = dataclasses.replace(params, seed=seed * 1_000_003 + start)
        ids = [list(p.ids) for p in chunk]
        if multi_turn is None:
            result = engine.generate(ids, chunk_params)
        else:
            result = multi_turn.generate(engine, ids, [p.row for p in chunk], chunk_params)
        if len(result) != len(chunk) or any(len(c) != params.n for c in result):
            raise RuntimeError(
                f"engine returned {[len(c) for c in result]} samples per prompt, expected {params.n}"
            )
        completions.extend(result)
    return completions


def _records(
    items: list[tuple[str, int, Prompt]], completions: list[list[Any]], tokenizer: Any
) -> list[dict[str, Any]]:
    """One ``samples.jsonl`` record per sample (its reward is added once scored)."""
    records = []
    for (name, i, p), samples in zip(items, completions, strict=True):
        for j, c in enumerate(samples):
            traj = Trajectory.of(c)
            records.append(
                {
                    "benchmark": name,
                    "prompt_index": i,
                    "sample_index": j,
                    "source": p.row.source,
                    "system": p.row.system,
                    "prompt": p.row.prompt,
                    "answer": p.row.answer,
                    "kind": p.row.kind,
                    "response": tokenizer.decode(c.token_ids, skip_special_tokens=True),
                    "num_tokens": len(c.token_ids),
                    "finish_reason": c.finish_reason,
                    "weight_version": c.weight_version,
                    **({} if traj is None else _trajectory_fields(traj)),
                }
            )
    return records


def _trajectory_fields(traj: Trajectory) -> dict[str, Any]:
    """A trajectory's record fields: its assistant turns as ``response`` (what the verifier reads), its
    turns, tool calls, the environment's reward parts and whether a fault failed it."""
    return {
        "response": traj.assistant_text,
        "turns": traj.turns,
        "tool_calls": traj.tool_calls,
        "env_reward": float(sum(traj.turn_rewards)),
        "tool_failed": traj.failed,
    }


def _score(records: list[dict[str, Any]], reward_pool: RewardPool | None) -> RewardResult:
    """Score every record with its row's reward kind; sets each record's ``reward``."""
    own_pool = reward_pool is None
    pool = reward_pool or RewardPool(num_workers=2)
    try:
        scored = pool.score(
            [r["kind"] for r in records], [r["response"] for r in records], [r["answer"] for r in records]
        )
    finally:
        if own_pool:
            pool.close()
    for r, reward in zip(records, scored.rewards, strict=True):
        r["reward"] = reward
    return scored


def _scores(
    benchmarks: Mapping[str, Sequence[Prompt]], records: list[dict[str, Any]], k: int
) -> dict[str, Any]:
    """``benchmarks`` (avg@k, pass@k and lengths per benchmark) and ``mean_avg_at_k`` of the summary."""
    per_bench: dict[str, dict[str, float]] = {}
    for name, ps in benchmarks.items():
        rs = [r for r in records if r["benchmark"] == name]
        per_prompt = [sum(r["reward"] for r in rs if r["prompt_index"] == i) / k for i in range(len(ps))]
        per_bench[name] = {
            "avg_at_k": sum(per_prompt) / len(per_prompt),
            "pass_at_k": sum(v > 0 for v in per_prompt) / len(per_prompt),
            "num_prompts": len(ps),
            "num_samples": len(rs),
            "response_tokens_mean": sum(r["num_tokens"] for r in rs) / len(rs),
            "truncated_frac": sum(r["finish_reason"] == "length" for r in rs) / len(rs),
        }
    mean = sum(b["avg_at_k"] for b in per_bench.values()) / len(per_bench)
    return {"benchmarks": per_bench, "mean_avg_at_k": mean}


def build_eval_benchmarks(
    data: DataConfig, tokenizer: Any, limit: int | None = None
) -> dict[str, list[Prompt]]:
    """Held-out prompts of a recipe grouped by benchmark (eval files, plus the arithmetic held-out split)."""
    ds = PromptDataset.from_files(data.eval_files, tokenizer, data)
    benches = ds.benchmarks()
    if data.arithmetic is not None:
        extra = PromptDataset.from_rows(arithmetic_rows(data.arithmetic, "test"), tokenizer, data)
        for name, ps in extra.benchmarks().items():
            benches.setdefault(name, []).extend(ps)
    if limit is not None:
        benches = {name: ps[:limit] for name, ps in benches.items()}
    return benches


def run_eval(
    engine: RolloutEngine,
    tokenizer: Any,
    data: DataConfig,
    cfg: EvalConfig,
    out_dir: str | Path,
    *,
    step: int | None = None,
    reward_pool: RewardPool | None = None,
    allow_reward_errors: bool = False,
    multi_turn: Any | None = None,
) -> dict[str, Any]:
    """Evaluate ``engine`` on the recipe's held-out benchmarks; what ``srpo eval`` and the trainer call
    (``allow_reward_errors``, ``multi_turn``: see ``evaluate``)."""
    benches = build_eval_benchmarks(data, tokenizer, cfg.max_prompts_per_benchmark)
    own_pool = reward_pool is None
    pool = reward_pool or RewardPool(num_workers=cfg.reward_workers, timeout_s=cfg.reward_timeout_s)
    try:
        return evaluate(
            engine,
            benches,
            tokenizer,
            out_dir,
            k=cfg.k,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            max_new_tokens=cfg.max_new_tokens,
            seed=cfg.seed,
            prompts_per_call=cfg.prompts_per_call,
            reward_pool=pool,
            step=step,
            allow_reward_errors=allow_reward_errors,
            multi_turn=multi_turn,
        )
    finally:
        if own_pool:
            pool.close()


def greedy_accuracy(
    engine: Any,
    tokenizer: Any,
    cfg: Any,
    out_dir: Path,
    step: int | None = None,
    allow_reward_errors: bool | None = None,
) -> float:
    """Held-out accuracy of one greedy sample per problem (temperature 0, k = 1); ``cfg`` the recipe
    (``allow_reward_errors``: default the recipe's ``rollout.allow_reward_errors``)."""
    greedy_cfg = dataclasses.replace(cfg.eval, k=1, temperature=0.0, top_p=1.0)
    allow = cfg.rollout.allow_reward_errors if allow_reward_errors is None else allow_reward_errors
    mt = multi_turn_rollout(cfg, tokenizer)  # trajectories, as in avg@k
    summary = run_eval(
        engine, tokenizer, cfg.data, greedy_cfg, out_dir, step=step, allow_reward_errors=allow, multi_turn=mt
    )
    return summary["mean_avg_at_k"]
