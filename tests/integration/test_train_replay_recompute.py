"""End-to-end ``srpo train`` with routing replay (R3) under full activation recompute, for the three sigmoid /
biased-router families: tiny DeepSeek-V3, GLM-4.5 and gpt-oss, on gloo ranks with the CPU rollout engine.

The engine routes differently from the trainer: after every weight sync its routers' weights (and expert
biases) are perturbed, a stand-in for a real SGLang engine's bf16 / kernel differences. Per family:

- 3 SRPO steps at EP2 with ``performance.recompute=full`` and replay: the trainer uses the engine's experts
  on every response token of every MoE layer (``moe/topk_mismatch_share`` 0) although its own router would
  choose otherwise, and the first step's loss and gradient norm equal the same run without recompute
  (<= 1e-5): the recompute in backward replays the micro-batch's own experts (``compat/router_replay.py``).
- Qwen3-MoE at PP2 (1F1B over 4 micro-batches: micro-batch k+1's forward runs before k's backward, where a
  replay of the last-set experts went wrong) with full recompute equals the PP1 step with replay.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from srpo_megatron.testing.distributed import run_distributed

pytestmark = [pytest.mark.moe, pytest.mark.timeout(3600)]

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "examples" / "tiny_cpu_test.yaml"
ROUTER_NOISE = 0.3  # std of the noise added to the engine's router weights (drawn with std 0.5)
BIAS_NOISE = 0.1  # std of the noise added to the engine's expert biases (drawn with std 0.3)


def _write_gpt_oss(out: Path) -> Path:
    """The tiny gpt-oss (sinks, sliding/full layers, YaRN, clamped SwiGLU, 4 experts top-2) sized to the real
    Qwen vocabulary, with its tokenizer, saved as an HF folder."""
    from srpo_megatron.data.assets import qwen3_tokenizer
    from srpo_megatron.testing.tiny import tiny_gpt_oss_model

    tok = qwen3_tokenizer()
    model = tiny_gpt_oss_model(
        seed=3,
        vocab_size=len(tok),
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        bos_token_id=None,
    )
    # Embeddings at std 1, not the config's 0.02: with every bias nonzero, the attention's constant o_proj
    # bias (std 0.2) swamps 0.02-sized embeddings in the residual stream, every token reaches the routers
    # with nearly the same normed input and the trainer sends all to one expert pair (load max/mean 2.0);
    # the replay-off control then measured only the perturbed engine's choice of another constant pair.
    with torch.no_grad():
        model.model.embed_tokens.weight.normal_(0.0, 1.0)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module", params=["deepseek", "glm", "gpt_oss"])
def tiny(request, tmp_path_factory):
    from srpo_megatron.testing.tiny import write_tiny_deepseek, write_tiny_glm_moe

    root = tmp_path_factory.mktemp(f"replay_{request.param}")
    writer = {"deepseek": write_tiny_deepseek, "glm": write_tiny_glm_moe, "gpt_oss": _write_gpt_oss}
    hf = writer[request.param](root / request.param)
    data = root / "train.jsonl"
    rows = [
        {"prompt": f"Tell me a fact about the number {i}.", "system": None, "answer": "-", "kind": "coin"}
        for i in range(16)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return request.param, root, hf, data


def _train_rank_perturbed_engine(rank, world, overrides):
    from srpo_megatron.config import TrainConfig, load_config
    from srpo_megatron.rollout.hf_engine import HFEngine
    from srpo_megatron.train import train

    install = HFEngine.update_weights

    def perturbed(self, named_tensors, version):
        install(self, named_tensors, version)
        g = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if name.endswith(("mlp.gate.weight", "mlp.router.weight")):  # DeepSeek/GLM, gpt-oss
                    p.add_(torch.randn(p.shape, generator=g) * ROUTER_NOISE)
            for name, b in self.model.named_buffers():
                if name.endswith("mlp.gate.e_score_correction_bias"):
                    b.add_(torch.randn(b.shape, generator=g) * BIAS_NOISE)

    HFEngine.update_weights = perturbed
    return train(load_config(TrainConfig, str(RECIPE), overrides))


def _run(tiny, name: str, world: int, **extra) -> list[dict]:
    family, root, hf, data = tiny
    run_dir = root / name
    overrides = [f"model.hf_dir={hf}", f"data.train_files=[{data}]", f"run.dir={run_dir}"]
    overrides += ["rollout.routing_replay=true"]  # unless ``extra`` turns it off
    if family == "deepseek":  # max_position_embeddings 128 (YaRN 4 x 32): the sequence budget stays within
        overrides += ["model.max_sequence_length=128", "data.max_prompt_tokens=120"]
    overrides += [f"{k}={v}" for k, v in extra.items()]
    run_distributed(_train_rank_perturbed_engine, world, overrides, timeout=1800)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _same_step(row: dict, ref: dict) -> None:
    assert row["reward/mean"] == ref["reward/mean"], "same seed, same weights: same rollouts"
    assert row["loss/total"] == pytest.approx(ref["loss/total"], abs=1e-5)
    assert row["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)


def test_three_steps_at_ep2_with_full_recompute_replay_the_engines_experts(tiny):
    ref = _run(tiny, "ep2", 2, **{"parallel.ep": 2, "train.steps": 1})
    rows = _run(tiny, "ep2_full", 2, **{"parallel.ep": 2, "performance.recompute": "full"})
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["train/skipped_steps"] == 0.0 and r.get("engine/restarts", 0) == 0
        assert r["moe/topk_mismatch_share"] == 0.0, "replay: the engine's experts, every token and layer"
    _same_step(rows[0], ref[0])


def test_the_perturbed_engine_routes_differently_without_replay(tiny):
    """What lets the replay test fail: without replay the trainer's experts differ from the report."""
    off = {
        "parallel.ep": 2,
        "train.steps": 1,
        "performance.recompute": "full",
        "rollout.routing_replay": "false",
    }
    (row,) = _run(tiny, "ep2_full_off", 2, **off)
    assert row["moe/topk_mismatch_share"] > 0.0
    if tiny[0] == "gpt_oss":  # 4 experts, top-2: 2.0 is every token on one pair
        assert row["moe/expert_load_max_over_mean"] < 2.0, "the trainer spreads tokens over the experts"


@pytest.fixture(scope="module")
def tiny_qwen3_moe(tmp_path_factory):
    from srpo_megatron.testing.tiny import write_tiny_run

    return ("qwen3_moe", *write_tiny_run(tmp_path_factory.mktemp("replay_pp2"), num_prompts=16, moe=True))


def test_pp2_full_recompute_replays_each_micro_batch(tiny_qwen3_moe):
    """Qwen3-MoE (every layer MoE: each stage routes; a stage of only dense layers, as the tiny DeepSeek's
    first at PP2, stops the router metrics, ``models/moe_metrics.py``)."""
    ref = _run(tiny_qwen3_moe, "pp1", 1, **{"train.steps": 1})
    overrides = {"parallel.pp": 2, "train.steps": 1, "performance.recompute": "full"}
    (row,) = _run(tiny_qwen3_moe, "pp2_full", 2, **overrides)
    assert row["moe/topk_mismatch_share"] == 0.0
    _same_step(row, ref[0])
