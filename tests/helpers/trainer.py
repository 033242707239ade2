"""The trainer scaffold shared by the DP / resume / packing tests: the tiny recipe, a tiny 256-token Qwen3
policy folder (fixture ``tiny``), a Policy built from the recipe with an EMA teacher and the distributed
optimizer, fixed samples and one learning step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.recipe import RECIPE

TINY_POLICY_VOCAB = 256


def write_tiny_policy_run(out: Path) -> tuple[Path, Path]:
    """A 2-layer Qwen3 with a 256-token vocabulary under ``out/hf`` (weights and config: the trainer needs no
    tokenizer) and a one-prompt ``coin`` JSONL: (hf_dir, data)."""
    from srpo_megatron.testing.tiny import write_tiny_qwen3_no_tokenizer

    hf = write_tiny_qwen3_no_tokenizer(out / "hf", vocab_size=TINY_POLICY_VOCAB)
    data = out / "train.jsonl"
    data.write_text(json.dumps({"prompt": "x", "system": None, "answer": "-", "kind": "coin"}) + "\n")
    return hf, data


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """``write_tiny_policy_run`` once per module (the resume tests import this fixture)."""
    return write_tiny_policy_run(tmp_path_factory.mktemp("tiny_offload"))


def tiny_policy(tiny, run_dir, extra):
    from srpo_megatron.config import TrainConfig, load_config
    from srpo_megatron.parallel import initialize_model_parallel
    from srpo_megatron.trainer.state.policy import Policy

    hf, data = tiny
    ov = [
        f"model.hf_dir={hf}",
        f"data.train_files=[{data}]",
        f"run.dir={run_dir}",
        "parallel.distributed_optimizer=true",
        "optim.lr=0.02",
        "optim.clip_grad=0.0",
        "teacher.ema_alpha=0.3",
        *extra,
    ]
    return Policy(load_config(TrainConfig, str(RECIPE), ov), initialize_model_parallel(1, 1, seed=1))


def tiny_samples(rank: int, step: int):
    from srpo_megatron.trainer.step_types import Sample

    g = torch.Generator().manual_seed(1000 * step + rank)
    out = []
    for m in range(4):
        resp = torch.randint(10, TINY_POLICY_VOCAB, (6,), generator=g).tolist()
        out.append(Sample(0, m, [1, 2, 3, 4], resp, [-2.0] * 6, advantage=1.0 if m % 2 else -1.0))
    return out


def tiny_step(policy, rank: int, step: int) -> None:
    from srpo_megatron.trainer.passes.learning import learn
    from srpo_megatron.trainer.passes.scoring import scoring_pass

    learn(policy, scoring_pass(policy, tiny_samples(rank, step)), 1)
    policy.update_teacher()


def packing_samples():
    from srpo_megatron.trainer.step_types import Sample

    g = torch.Generator().manual_seed(7)
    out = []
    for m in range(8):
        prompt = torch.randint(10, 2000, (3 + m % 3,), generator=g).tolist()
        resp = torch.randint(10, 2000, (2 + (5 * m) % 9,), generator=g).tolist()
        sdpo = m % 2 == 1
        teacher = torch.randint(10, 2000, (6 + m,), generator=g).tolist() if sdpo else None
        logp = (-torch.rand(len(resp), generator=g) * 3).tolist()
        out.append(
            Sample(
                m // 4,
                m % 4,
                prompt,
                resp,
                logp,
                reward=float(not sdpo),
                advantage=0.5 if not sdpo else -0.5,
                grpo=not sdpo,
                sdpo=sdpo,
                needs_teacher=sdpo,
                teacher_prompt_ids=teacher,
            )
        )
    return out
