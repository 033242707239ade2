"""What the sample-pool and dynamic-sampling tests share: a character tokenizer, a scripted reward (the real
``RewardPool`` with ``workers=0`` scores it), and builders of completed groups.

A response's text starts with its reward: ``"1.0:tag"`` scores 1.0 under the ``scripted`` reward kind, so a
test writes down exactly which groups are mixed, all correct or all wrong.
"""

from __future__ import annotations

import torch

from srpo_megatron.config import LossConfig, RolloutConfig, TeacherConfig
from srpo_megatron.data.dataset import Prompt
from srpo_megatron.data.rows import Row
from srpo_megatron.rewards import register_reward
from srpo_megatron.rewards.pool import RewardPool
from srpo_megatron.rollout.base import Completion
from srpo_megatron.trainer.collect.sample_pool import CompletedGroup, SamplePool

G = 4  # members per group in these tests


def scripted_reward(response: str, answer: str) -> float:
    """The reward written at the head of the response (``"0.5:..."`` → 0.5)."""
    return float(response.split(":", 1)[0])


register_reward("scripted", scripted_reward)


class CharTokenizer:
    """Characters as token ids; enough of a HF tokenizer for routing and teacher prompts."""

    chat_template = "plain"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt, enable_thinking):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def __call__(self, text, add_special_tokens):
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids, skip_special_tokens):
        return "".join(chr(i) for i in ids)


def prompt(i: int, kind: str = "scripted") -> Prompt:
    return Prompt(tuple(ord(c) for c in f"q{i}"), Row(f"question {i}", None, "-", kind, "b", f"f:{i}"))


def completion(
    reward: float,
    tag: str,
    version: int = 0,
    newest: int | None = None,
    experts: bool = False,
    finish: str = "stop",
) -> Completion:
    """A completion whose scripted reward is ``reward``, dispatched at ``version``; with ``newest``, a partial
    rollout: its last token came from version ``newest``, the others from ``version``."""
    ids = [ord(c) for c in f"{reward}:{tag}"]
    return Completion(
        0,
        ids,
        [-0.25 - 0.01 * k for k in range(len(ids))],
        finish,  # type: ignore[arg-type]
        weight_version=version,
        token_versions=None if newest is None else [version] * (len(ids) - 1) + [newest],
        routed_experts=torch.arange(len(ids) * 4, dtype=torch.int32).view(len(ids), 2, 2)
        if experts
        else None,
    )


def group(
    dispatch: int,
    index: int,
    rewards: list[float],
    version: int = 0,
    newest: list[int | None] | None = None,
    **kw,
) -> CompletedGroup:
    """A completed group of ``len(rewards)`` members, each dispatched at ``version`` (``newest[m]``: member m
    is a partial rollout whose last token came from that version)."""
    last = newest or [None] * len(rewards)
    return CompletedGroup(
        prompt(100 * dispatch + index),
        [completion(r, f"d{dispatch}i{index}m{m}", version, last[m], **kw) for m, r in enumerate(rewards)],
        dispatch=dispatch,
        index=index,
        dataset_index=100 * dispatch + index,
    )


MIXED = [1.0, 0.0, 1.0, 0.0]
ALL_CORRECT = [1.0] * G
ALL_WRONG = [0.0] * G


def make_pool(rewards: RewardPool, loss: LossConfig | None = None, **rollout) -> SamplePool:
    cfg = RolloutConfig(prompts_per_step=rollout.pop("prompts_per_step", 2), group_size=G, **rollout)
    return SamplePool(CharTokenizer(), cfg, loss or LossConfig(), TeacherConfig(), rewards)
