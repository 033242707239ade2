"""Partial rollouts of multi-turn trajectories end to end: ``srpo train`` of the tiny recipe with the
calculator environment (``tests/helpers/scripted_calculator.py``'s ``ScriptedCalculator`` and seeded
stop ids, the stand-ins for a model that calls tools and ends its turns), separate placement, off-policy
(``rollout.off_policy_steps=1``, ``rollout.partial=true``), against the stand-in SGLang server in this
process (``testing/sglang_standin.py``), the trainer at world 1.

The stand-in holds one later-turn request (an assistant turn after a tool turn) of every round dispatched
ahead at its 3rd decode step until the sync's pause aborts it; the driver continues that turn after the
sync (``MultiTurnRollout.continue_partial``). Checked over 3 steps: 0 engine restarts, the steps trained
on those rounds have ``async/partial_share`` > 0 (a trajectory's tokens span two versions) and count the
aborted trajectories, and every step keeps multi-turn trajectories with tool calls.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from srpo_megatron.testing.distributed import run_distributed
from tests.helpers.recipe import standin_partial_overrides, tiny_config
from tests.helpers.train import read_metrics

pytestmark = [pytest.mark.timeout(1800)]

STEPS = 3
PROMPTS_PER_ROUND = 4  # the tiny recipe's rollout.prompts_per_step
OPENER = [151644, 77091, 198]  # "<|im_start|>assistant\n" in the Qwen vocabulary
ENV = "tests.helpers.scripted_calculator:ScriptedCalculator"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from srpo_megatron.testing.tiny import write_tiny_run

    return write_tiny_run(tmp_path_factory.mktemp("tiny_partial_mt"), num_prompts=16)


def _overrides(tiny) -> list[str]:
    return [
        *standin_partial_overrides(tiny),
        f"rollout.environment={ENV}",
        "rollout.max_new_tokens=96",
        "rollout.max_turns=4",
        f"train.steps={STEPS}",
        "run.save_every=0",
        "run.tensorboard=false",
        "train.eval_at_ends=false",
    ]


def _train(rank, world, tiny, run_dir, url):
    """One trainer rank, with test_train_multi_turn's seeded stop ids (a random model ends no turn)."""
    import dataclasses
    import os

    import torch

    from srpo_megatron.rollout.factory import load_tokenizer
    from srpo_megatron.train import train
    from srpo_megatron.trainer.collect import rollout_service

    os.environ["SRPO_ENGINE_URLS"], os.environ["SRPO_SYNC_HOST"] = url, "127.0.0.1"
    cfg = tiny_config(tiny, run_dir, _overrides(tiny))
    vocab = len(load_tokenizer(cfg.model.hf_dir))
    g = torch.Generator().manual_seed(0)
    stops = tuple(int(t) for t in torch.randperm(vocab, generator=g)[: vocab // 8])
    real = rollout_service.sampling_params
    rollout_service.sampling_params = lambda *a, **k: dataclasses.replace(real(*a, **k), stop_token_ids=stops)
    return train(cfg)


def _openers(ids: list[int]) -> list[int]:
    n = len(OPENER)
    return [i for i in range(len(ids) - n + 1) if ids[i : i + n] == OPENER]


def _hold_one_later_turn_per_round_ahead(server):
    """Step hook: the first later-turn request of each round but the first (the trainer waits for that
    one) and the one dispatched after the last step (no sync follows it) that reaches decode step 3 waits
    there until the sync's pause aborts it. Rounds are told apart
    by their prompts (each round has its own ``PROMPTS_PER_ROUND``, in order of first appearance); one in
    flight (``concurrent_requests=1``), so the last ``/generate`` body is the running request."""
    prompts: list[tuple[int, ...]] = []
    held: set[int] = set()

    def hook(step, aborted):  # after every decode step, numbered from 1
        bodies = [b for path, b in list(server.bodies) if path == "/generate"]
        ids = bodies[-1]["input_ids"]
        ids = list(ids[0] if ids and isinstance(ids[0], list) else ids)
        at = _openers(ids)
        key = tuple(ids[: at[0] + len(OPENER)]) if at else tuple(ids)
        if key not in prompts:  # every request decodes a step 1: no prompt is missed
            prompts.append(key)
        round_ = prompts.index(key) // PROMPTS_PER_ROUND
        if step == 3 and len(at) >= 2 and 1 <= round_ < STEPS and round_ not in held:
            held.add(round_)
            # a held request can also stall the round the trainer waits for (one request in flight): then
            # no sync comes and the hold ends here, the request finishing unaborted (bounded at 90 s)
            aborted.wait(timeout=90)

    return hook


def test_partial_rollouts_with_the_calculator_continue_aborted_turns_for_3_steps(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    from srpo_megatron.testing.sglang_standin import SGLangStandInServer

    server = SGLangStandInServer(AutoModelForCausalLM.from_pretrained(tiny[1]))
    server.engine.step_hook = _hold_one_later_turn_per_round_ahead(server)
    run_dir = tmp_path / "run"
    try:
        run_distributed(_train, 1, tiny, str(run_dir), server.url, timeout=1500)
    finally:
        server.close()
    metrics = read_metrics(run_dir)  # asserts 0 engine restarts
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert metrics[0]["async/partial_share"] == 0.0, "the first round is never held"
    for m in metrics[1:]:
        assert m["async/partial_share"] > 0, f"step {m['step']}: no trajectory spans the sync"
        assert m["rollout/aborted"] > 0, f"step {m['step']}: the sync aborted no trajectory"
    for m in metrics:
        assert m["multiturn/turns_max"] >= 2 and m["multiturn/tool_calls"] > 0
        assert m["train/skipped_steps"] == 0.0
    assert "/pause_generation" in [p for p, _ in server.bodies]
    rows = [json.loads(x) for x in (Path(run_dir) / "samples.jsonl").read_text().splitlines()]
    assert any(len(v) > 1 for r in rows[1:] for v in r["token_versions"]), (
        "a trained trajectory spans 2 versions"
    )
