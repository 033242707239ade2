"""Start-up checks of `srpo train`: layout divisibility, reward targets probed where they will run, and
data files decoded line by line (a non-UTF-8 line is one bad row, named ``file:line``)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from srpo_megatron.config import ConfigError
from srpo_megatron.data.rows import DataError, load_rows
from srpo_megatron.rewards import RewardPool
from srpo_megatron.trainer.run.preflight import check_attention_cp, check_before_model, check_layout

QWEN3_TINY = {"num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2}


def _cfg(tp=1, pp=1, prompts=4, group=4, mini=1) -> SimpleNamespace:
    return SimpleNamespace(
        parallel=SimpleNamespace(tp=tp, pp=pp),
        model=SimpleNamespace(hf_dir="/models/tiny"),
        rollout=SimpleNamespace(prompts_per_step=prompts, group_size=group),
        train=SimpleNamespace(mini_batches=mini),
    )


@pytest.mark.parametrize(
    ("cfg", "world", "message"),
    [
        (_cfg(tp=2), 3, "3 processes cannot be split into parallel.tp=2"),
        (_cfg(tp=4), 4, "2 key/value heads (GQA groups) do not divide by parallel.tp=4"),
        (_cfg(pp=4), 4, "pipeline parallel size 4 must be between 1 and num_hidden_layers=2"),
        (
            _cfg(prompts=3, group=2, mini=2),
            2,
            "6 samples per step do not split into train.mini_batches=2 × data",
        ),
        (_cfg(tp=2, prompts=3, group=2), 8, "6 samples per step do not split"),  # DP = 4
    ],
)
def test_layouts_that_do_not_divide_are_refused_before_the_model(cfg, world, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_layout(cfg, world, QWEN3_TINY)


def test_layouts_that_divide_pass():
    check_layout(_cfg(tp=2, pp=2, prompts=4, group=4, mini=2), 8, QWEN3_TINY)  # DP 2: 16 % 4 == 0
    # PP need not divide the layers: 3 layers at PP2 are stages of 1 and 2 (pipeline_stage_layers).
    check_layout(_cfg(pp=2), 2, {**QWEN3_TINY, "num_hidden_layers": 3})


@pytest.fixture
def reward_modules(tmp_path, monkeypatch):
    (tmp_path / "hanging_reward.py").write_text(
        "import time\ntime.sleep(3600)\n\ndef reward(r, a):\n    return 1.0\n"
    )
    (tmp_path / "odd_reward.py").write_text(
        "NOT_A_FUNCTION = 3\n\ndef picky(r, a):\n    raise ValueError(a)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))  # spawned workers inherit sys.path
    yield
    for name in ("hanging_reward", "odd_reward"):
        sys.modules.pop(name, None)


@pytest.mark.parametrize("workers", [0, 1])
def test_reward_targets_are_probed_with_timeouts(reward_modules, workers):
    # The import clock includes starting the worker process: generous here, short for the hanging one.
    with RewardPool(workers, timeout_s=30, import_timeout_s=120) as pool:
        assert pool.check_targets(["srpo_megatron.testing.tiny:coin_reward", "odd_reward:picky"]) is None
        typo = pool.check_targets(["srpo_megatron.testing.tiny:coin_rewrad"])
        assert "reward target 'srpo_megatron.testing.tiny:coin_rewrad': " in typo and "AttributeError" in typo
        assert "not a function" in pool.check_targets(["odd_reward:NOT_A_FUNCTION"])
    with RewardPool(workers, timeout_s=30, import_timeout_s=3) as pool:
        assert "its import did not finish" in pool.check_targets(["hanging_reward:reward"])


def test_scoring_with_a_hanging_import_times_out_instead_of_hanging(reward_modules, monkeypatch):
    from srpo_megatron.rewards import registry

    monkeypatch.setitem(registry._REGISTRY, "hangs", "hanging_reward:reward")
    with RewardPool(1, timeout_s=5, import_timeout_s=2) as pool:
        result = pool.score(["hangs", "hangs"], ["a", "b"], ["x", "y"])
    assert result.rewards == [0.0, 0.0] and result.num_timeouts == 2
    assert "import did not finish in 2s" in result.errors[0]


def _rows_file(path: Path) -> Path:
    good = b'{"prompt": "p", "system": null, "answer": "1", "kind": "arithmetic"}\n'
    path.write_bytes(good + b'{"prompt": "caf\xe9", "answer": "1", "kind": "arithmetic"}\n' + good)
    return path


def test_non_utf8_data_line_names_file_and_line(tmp_path):
    path = _rows_file(tmp_path / "rows.jsonl")
    with pytest.raises(DataError, match=rf"^{path}:2: not UTF-8 text \(byte b'\\xe9' at column 16\)$"):
        load_rows(path)


def test_non_utf8_data_line_is_skipped_and_counted(tmp_path):
    rows, report = load_rows(_rows_file(tmp_path / "rows.jsonl"), skip_bad=True)
    assert (
        len(rows) == 2
        and report.num_bad == 1
        and report.first_errors[0].startswith(f"{tmp_path}/rows.jsonl:2:")
    )


@pytest.mark.parametrize(
    ("model", "extra", "message"),
    [
        (
            "dense",
            ["rollout.routing_replay=true"],
            "is a dense model (no experts); set rollout.routing_replay=false",
        ),
        ("moe", ["rollout.routing_replay=true", "performance.recompute=full"], None),
        ("dense", [], None),
        ("moe", ["rollout.routing_replay=true"], None),
        (
            "dense",
            ["performance.recompute=selective", "performance.recompute_modules=[moe]"],
            "recompute_modules=.'moe'. recomputes MoE layers but model.hf_dir .* is a dense model; use mlp",
        ),
        ("moe", ["performance.recompute=selective", "performance.recompute_modules=[moe]"], None),
    ],
    ids=[
        "replay-on-dense",
        "replay-with-full-recompute-runs",
        "dense",
        "moe-replay",
        "moe-recompute-on-dense",
        "moe-recompute",
    ],
)
def test_the_start_up_checks_refuse_expert_replay_it_cannot_honour(tmp_path, model, extra, message):
    """``check_before_model`` (what `srpo train` runs before megatron) includes the MoE replay refusals."""
    import json

    from srpo_megatron.testing.tiny import tiny_hf_config, tiny_moe_config
    from tests.helpers.recipe import tiny_config

    hf = tmp_path / model
    hf.mkdir()
    config = (tiny_hf_config("qwen3") if model == "dense" else tiny_moe_config()).to_dict()
    config["max_position_embeddings"] = 4096  # the tiny recipe's 256-token sequences fit
    (hf / "config.json").write_text(json.dumps(config))
    cfg = tiny_config((tmp_path, hf, tmp_path / "train.jsonl"), tmp_path / "run", extra)
    if message is None:
        check_before_model(cfg, 1)
    else:
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            check_before_model(cfg, 1)


# ---- context parallelism with gpt-oss's learnable attention sinks ----------------------------------------

GPT_OSS_RECIPE = Path(__file__).resolve().parents[2] / "examples" / "gpt_oss_20b_srpo.yaml"


def _gpt_oss(*overrides: str):
    from srpo_megatron.config import load_recipe
    from srpo_megatron.planner.command import resolve_hf_config

    packing = ["train.max_tokens_per_micro_batch=8192"]  # CP needs packing (recipe rule)
    cfg = load_recipe(GPT_OSS_RECIPE, packing + list(overrides))
    return cfg, resolve_hf_config(cfg.model.hf_dir)[0]  # the packaged gpt-oss-20b config.json


def test_gpt_oss_sinks_under_cp_need_the_a2a_exchange():
    """TE's fused attention takes learnable sinks under CP only with cp_comm_type a2a (it falls back to
    unfused attention otherwise): the shipped gpt-oss recipe with CP2 is refused in one line by the trainer's
    start-up check and by `srpo launch`'s; a2a passes; CP1 never asks."""
    from srpo_megatron.launch.start_checks import check_before_submit
    from srpo_megatron.trainer.run.preflight import check_attention_cp

    cfg, hf = _gpt_oss("parallel.cp=2")
    assert hf["model_type"] == "gpt_oss" and cfg.parallel.cp_comm_type == "p2p"  # the default
    for check in (lambda: check_attention_cp(cfg, hf), lambda: check_before_submit(cfg, 128, log=print)):
        with pytest.raises(ConfigError, match=r"parallel\.cp=2 with parallel\.cp_comm_type=p2p") as e:
            check()
        assert "\n" not in str(e.value) and "set parallel.cp_comm_type: a2a" in str(e.value)
    for comm in ("all_gather", "a2a+p2p"):
        with pytest.raises(ConfigError, match="learnable attention sinks"):
            check_attention_cp(*_gpt_oss("parallel.cp=2", f"parallel.cp_comm_type={comm}"))
    check_attention_cp(*_gpt_oss("parallel.cp=2", "parallel.cp_comm_type=a2a"))  # 64 / tp4 = 16 heads
    check_attention_cp(*_gpt_oss())  # CP1
    check_attention_cp(_cfg(), {**QWEN3_TINY, "model_type": "qwen3"})  # no sinks, no CP: nothing to check


def test_a2a_needs_each_tp_ranks_heads_to_split_over_cp():
    cfg, hf = _gpt_oss("parallel.cp=4", "parallel.cp_comm_type=a2a")  # 8 KV heads / tp4 = 2 per rank
    with pytest.raises(ConfigError, match=r"2 key/value heads \(8 / parallel.tp=4\) over parallel.cp=4"):
        check_attention_cp(cfg, hf)


def test_cp_comm_type_reaches_megatrons_transformer_config():
    """The key is megatron's own ``cp_comm_type`` (the trainer passes it to ``build_policy`` when CP > 1)."""
    from srpo_megatron.models.architecture import Architecture
    from srpo_megatron.models.policy import transformer_config_from_hf

    cfg, hf = _gpt_oss("parallel.cp=2", "parallel.cp_comm_type=a2a")
    tc = transformer_config_from_hf(
        Architecture.from_hf({**hf, "num_hidden_layers": 2, "layer_types": hf["layer_types"][:2]}),
        context_parallel_size=2,
        cp_comm_type=cfg.parallel.cp_comm_type,
    )
    assert tc.cp_comm_type == "a2a" and tc.softmax_type == "learnable"
