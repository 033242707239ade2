"""Recipes load strictly into the typed TrainConfig; bad input names the key, the value and the fix."""

from pathlib import Path

import pytest

from srpo_megatron.config import ConfigError, TrainConfig, load_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
RECIPES = sorted(p for p in EXAMPLES.glob("*.yaml"))


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_every_example_recipe_loads(path):
    cfg = load_config(TrainConfig, path)
    assert cfg.loss.temperature == cfg.rollout.temperature


def test_paper_recipes_carry_the_paper_hyperparameters():
    srpo = load_config(TrainConfig, EXAMPLES / "qwen3_8b_srpo.yaml")
    grpo = load_config(TrainConfig, EXAMPLES / "qwen3_8b_grpo.yaml")
    sdpo = load_config(TrainConfig, EXAMPLES / "qwen3_8b_sdpo.yaml")
    assert (srpo.rollout.prompts_per_step, srpo.rollout.group_size) == (32, 8)
    assert (srpo.optim.lr, grpo.optim.lr, sdpo.optim.lr) == (5e-6, 1e-6, 1e-5)
    assert (srpo.train.mini_batches, grpo.train.mini_batches, sdpo.train.mini_batches) == (1, 4, 1)
    assert srpo.loss.top_k == 100 and srpo.loss.divergence_alpha == 0.5 and srpo.teacher.ema_alpha == 0.05
    assert srpo.loss.eps_high == 0.28 and srpo.loss.tis_cap == 2.0 and srpo.loss.beta == 1.0
    assert (srpo.eval.k, srpo.eval.temperature, srpo.eval.top_p) == (16, 0.6, 0.95)


def test_unknown_key_lists_valid_keys(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("model: {hf_dir: x}\ndata: {train_files: [a.jsonl]}\ntrain: {stepz: 3}\n")
    with pytest.raises(ConfigError, match=r"stepz.*valid keys of TrainLoopConfig are .*'steps'"):
        load_config(TrainConfig, p)


def test_bad_values_say_what_and_how_to_fix(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("model: {hf_dir: x}\ndata: {train_files: [a.jsonl]}\n")
    with pytest.raises(ConfigError, match=r"group_size=1 >= 2"):
        load_config(TrainConfig, p, ["rollout.group_size=1"])
    with pytest.raises(ConfigError, match=r"loss.temperature is not a recipe key.*set rollout.temperature"):
        load_config(TrainConfig, p, ["loss.temperature=0.7"])
    with pytest.raises(ConfigError, match=r"loss.mode.*'srpo'"):
        load_config(TrainConfig, p, ["loss.mode=ppo"])
    with pytest.raises(ConfigError, match=r"train.steps: expected an integer, got 'many'"):
        load_config(TrainConfig, p, ["train.steps=many"])
    with pytest.raises(ConfigError, match=r"model.hf_dir is empty"):
        load_config(TrainConfig, p, ["model.hf_dir="])
    with pytest.raises(ConfigError, match=r"does not exist"):
        load_config(TrainConfig, tmp_path / "missing.yaml")
