"""The paper's data protocol in the recipes: one run per benchmark, its own held-out split, eval every 5."""

from pathlib import Path

import pytest

from srpo_megatron.config import TrainConfig, load_config
from srpo_megatron.data.paths import default_data_dir

RECIPE = Path(__file__).resolve().parents[2] / "examples" / "qwen3_8b_srpo_per_domain.yaml"
DOMAINS = ("chemistry", "physics", "biology", "material")


@pytest.mark.parametrize("domain", DOMAINS)
def test_one_run_per_domain_through_the_documented_override(domain):
    text = RECIPE.read_text()
    overrides = [
        f"data.train_files=[sciknoweval/{domain}/train.jsonl]",
        f"data.eval_files=[sciknoweval/{domain}/test.jsonl]",
    ]
    assert all(f"--override {o}".replace(domain, "physics") in text for o in overrides)  # as documented
    cfg = load_config(TrainConfig, RECIPE, overrides)
    assert cfg.data.train_files == [f"sciknoweval/{domain}/train.jsonl"]
    assert cfg.data.eval_files == [f"sciknoweval/{domain}/test.jsonl"]
    assert cfg.eval.every_n_steps == 5 and cfg.eval.k == 16 and cfg.optim.lr == 5e-6


def test_tool_use_is_evaluation_only_because_its_train_split_is_absent():
    cfg = load_config(TrainConfig, RECIPE)
    assert not any("tooluse" in f for f in cfg.data.train_files)
    assert "EVALUATION-ONLY" in RECIPE.read_text()
    data = default_data_dir()
    if (data / "tooluse").is_dir():  # the benchmark data, where present, has no tool-use train split
        assert (data / "tooluse" / "test.jsonl").is_file() and not (data / "tooluse" / "train.jsonl").exists()
