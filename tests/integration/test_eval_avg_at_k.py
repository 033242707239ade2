"""avg@k end to end on the real SmolLM2-135M-Instruct through the CPU rollout engine (HFEngine).

The summary's avg@k must equal a direct float64 computation from the written samples, each written
reward must match an independent re-scoring of the written response, and the easy arithmetic level must
give the untrained model a learnable share of right answers (neither ~0 nor ~1) greedily.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from fractions import Fraction

import pytest

from srpo_megatron.config import ArithmeticTaskConfig, DataConfig, EvalConfig
from srpo_megatron.data.assets import smollm2_gguf_path, smollm2_tokenizer
from srpo_megatron.evaluation import evaluate, run_eval
from srpo_megatron.evaluation.avg_at_k import build_eval_benchmarks
from srpo_megatron.rewards import RewardPool
from srpo_megatron.rollout.hf_engine import HFEngine, HFEngineConfig


@pytest.fixture(scope="module")
def engine():
    path = smollm2_gguf_path()
    eng = HFEngine.from_config(HFEngineConfig(model_path=str(path.parent), gguf_file=path.name))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def tokenizer():
    return smollm2_tokenizer()


def reference_reward(sample: dict) -> float:
    """Independent re-scoring: MCQ by the last <answer> block; arithmetic by the last number."""
    if sample["kind"] == "mcq":
        blocks = sample["response"].split("<answer>")[1:]
        last = [b.split("</answer>")[0] for b in blocks if "</answer>" in b]
        return float(bool(last) and last[-1].strip() == sample["answer"])
    numbers = re.findall(r"-?[\d,]*\d(?:\.\d+)?", sample["response"])
    return float(bool(numbers) and Fraction(numbers[-1].replace(",", "")) == int(sample["answer"]))


def test_avg_at_k_equals_direct_computation_from_written_samples(engine, tokenizer, tmp_path):
    data = DataConfig(
        eval_files=["sciknoweval/physics/test.jsonl"],
        arithmetic=ArithmeticTaskConfig(difficulty=0, num_eval=6),
        max_prompt_tokens=1024,
    )
    benches = build_eval_benchmarks(data, tokenizer, limit=6)
    benches["sciknoweval/physics"] = benches["sciknoweval/physics"][:1]
    k = 4
    with RewardPool(num_workers=0) as pool:
        summary = evaluate(
            engine,
            benches,
            tokenizer,
            tmp_path,
            k=k,
            max_new_tokens=12,
            seed=7,
            prompts_per_call=3,
            reward_pool=pool,
            step=5,
        )
    samples = [json.loads(s) for s in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == k * sum(len(ps) for ps in benches.values())
    by_prompt: dict[tuple[str, int], list[float]] = defaultdict(list)
    for s in samples:
        assert s["reward"] == reference_reward(s)
        assert 1 <= s["num_tokens"] <= 12 and s["finish_reason"] in ("stop", "length")
        by_prompt[(s["benchmark"], s["prompt_index"])].append(s["reward"])
    assert all(len(v) == k for v in by_prompt.values())
    direct = {}
    for name, ps in benches.items():
        means = [sum(by_prompt[(name, i)]) / k for i in range(len(ps))]
        direct[name] = sum(means) / len(means)
        assert summary["benchmarks"][name]["avg_at_k"] == pytest.approx(direct[name], abs=1e-12)
    assert summary["mean_avg_at_k"] == pytest.approx(sum(direct.values()) / len(direct), abs=1e-12)
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["benchmarks"] == summary["benchmarks"] and on_disk["step"] == 5 and on_disk["k"] == k
    # The arithmetic samples are mixed, so avg@k is a real average and not a constant 0 or 1.
    assert 0 < direct["arithmetic/level0"] < 1


def test_easy_arithmetic_is_learnable_greedy(engine, tokenizer, tmp_path):
    data = DataConfig(arithmetic=ArithmeticTaskConfig(difficulty=0, num_eval=32))
    cfg = EvalConfig(k=1, temperature=0.0, max_new_tokens=20, prompts_per_call=32, reward_workers=0)
    summary = run_eval(engine, tokenizer, data, cfg, tmp_path)
    acc = summary["benchmarks"]["arithmetic/level0"]["avg_at_k"]
    print(f"SmolLM2-135M greedy accuracy on arithmetic level 0 (32 held-out prompts): {acc:.3f}")
    assert 0.25 <= acc <= 0.75
