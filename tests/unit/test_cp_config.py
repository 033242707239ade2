"""``parallel.cp`` is refused before anything loads unless packing is on, and the layout check counts it."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from srpo_megatron.config import ConfigError, TrainConfig, load_config
from srpo_megatron.trainer.run.preflight import check_layout

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu_test.yaml"
QWEN3_TINY = {"num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2}


@pytest.mark.parametrize("budget", [0, 30])  # off; not a multiple of 2·cp = 4
def test_cp_without_a_packing_budget_is_refused_naming_file_and_keys(budget):
    ov = ["parallel.cp=2", f"train.max_tokens_per_micro_batch={budget}"]
    with pytest.raises(ConfigError) as e:
        load_config(TrainConfig, RECIPE, ov)
    msg = str(e.value)
    assert str(RECIPE) in msg and "parallel.cp=2" in msg, msg
    assert f"train.max_tokens_per_micro_batch={budget} must be a positive multiple of 4" in msg, msg


def test_cp_with_packing_loads():
    cfg = load_config(TrainConfig, RECIPE, ["parallel.cp=2", "train.max_tokens_per_micro_batch=256"])
    assert cfg.parallel.cp == 2


def _cfg(tp=1, pp=1, cp=1, prompts=4, group=4, mini=1) -> SimpleNamespace:
    return SimpleNamespace(
        parallel=SimpleNamespace(tp=tp, pp=pp, cp=cp),
        model=SimpleNamespace(hf_dir="/models/tiny"),
        rollout=SimpleNamespace(prompts_per_step=prompts, group_size=group),
        train=SimpleNamespace(mini_batches=mini),
    )


def test_layout_counts_cp():
    with pytest.raises(
        ConfigError, match=r"3 processes cannot be split into parallel.tp=1 × parallel.pp=1 × "
    ):
        check_layout(_cfg(cp=2), 3, QWEN3_TINY)
    # world 8 = TP2 × CP2 × DP2: 16 samples split into 2 mini-batches × DP 2; DP would be 4 without CP
    check_layout(_cfg(tp=2, cp=2, prompts=3, group=4, mini=2), 8, QWEN3_TINY)
    with pytest.raises(ConfigError, match=r"data-parallel size 4 .* cp=1"):
        check_layout(_cfg(tp=2, cp=1, prompts=3, group=4, mini=2), 8, QWEN3_TINY)
