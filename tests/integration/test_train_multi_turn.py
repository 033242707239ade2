"""End-to-end ``srpo train`` with ``rollout.environment`` set to the calculator: 3 SRPO steps on the tiny
recipe (random tiny Qwen3 with the real Qwen vocabulary, CPU rollout engine, gloo rank).

Every step logs the ``multiturn/*`` metrics, some trajectories take several turns with tool tokens in them,
and the trainer trains on the assistant tokens only: ``tokens/total`` (what the loss counted) equals the
response tokens minus the tool tokens, minus the off-policy rejections. 0 engine restarts (``read_metrics``).

Two stand-ins, both because a random model writes neither ``<|im_end|>`` nor tool calls:
- the sampling parameters gain a seeded eighth of the vocabulary as stop ids, so that turns end (as in
  ``tests/unit/test_multi_turn_service.py``);
- ``ScriptedCalculator`` (``tests/helpers/scripted_calculator.py``) is the real ``CalculatorEnv`` fed a
  scripted ``<tool_call>`` after the engine's text on the first two turns (a model that calls the
  calculator twice, then answers). The engine's ids, the template's tool-turn ids and the calculator's
  answers are the production ones.
"""

from __future__ import annotations

import pytest

from srpo_megatron.testing.distributed import run_distributed
from srpo_megatron.trainer.step_types import METRICS
from tests.helpers.scripted_calculator import ENV, multi_turn_rank
from tests.helpers.train import read_metrics, train_overrides

pytestmark = [pytest.mark.timeout(1800)]

MULTITURN = [name for name in METRICS if name.startswith("multiturn/")]
GROUP = 4 * 4  # prompts_per_step x group_size of the recipe


def _train(tiny, name: str, drop_mask: bool = False) -> list[dict]:
    run_dir = tiny[0] / name
    extra = {"rollout.environment": ENV, "rollout.max_new_tokens": 96, "rollout.max_turns": 4}
    run_distributed(multi_turn_rank, 1, train_overrides(tiny, run_dir, **extra), drop_mask, timeout=1200)
    return read_metrics(run_dir)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from srpo_megatron.testing.tiny import write_tiny_run

    return write_tiny_run(tmp_path_factory.mktemp("tiny_mt_train"), num_prompts=16)


def _assistant_tokens_only(r: dict) -> None:
    """The loss counted the response tokens less the tool tokens (and less the off-policy rejections)."""
    response = r["response/length_mean"] * GROUP
    assistant = response * (1.0 - r["multiturn/tool_token_frac"])
    kept = assistant * (1.0 - r["loss/is_masked_frac"] - r.get("loss/stale_masked_frac", 0.0))
    assert r["tokens/total"] == pytest.approx(kept, abs=0.5), f"step {r['step']}: tool tokens trained"


def test_three_srpo_steps_with_the_calculator_train_assistant_tokens_only(tiny):
    rows = _train(tiny, "calc")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        missing = [k for k in MULTITURN if k not in r]
        assert not missing, f"step {r['step']} lacks {missing}"
        assert r["multiturn/turns_max"] >= 2 and r["multiturn/tool_calls"] > 0
        assert r["multiturn/tool_errors"] > 0, "the scripted unknown tool is answered with an error"
        assert 0.0 < r["multiturn/tool_token_frac"] < 1.0
        assert r["train/skipped_steps"] == 0.0
        _assistant_tokens_only(r)


def test_a_mask_dropped_in_route_groups_is_caught(tiny):
    """The planted bug: ``route_groups`` ignores the rollout's mask, the tool tokens are trained on."""
    row = _train(tiny, "calc_no_mask", drop_mask=True)[0]
    with pytest.raises(AssertionError, match="tool tokens trained"):
        _assistant_tokens_only(row)
