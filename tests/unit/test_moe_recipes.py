"""The MoE recipes (Qwen3-MoE, GLM-4.5-Air, gpt-oss-20b) load strictly, their layouts fit the models they
name, and `srpo launch --dryrun` accepts them; the ``moe:`` keys validate with a named error."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
import yaml

from srpo_megatron.config import ConfigError, MoEConfig, TrainConfig, load_config
from srpo_megatron.launch import commands

REPO = Path(__file__).resolve().parents[2]
# (recipe, nodes, the model's layers / experts / KV heads / moe_intermediate_size from its config.json)
RECIPES = [
    ("examples/qwen3_30b_a3b_srpo.yaml", 2, 48, 128, 4, 768),
    ("examples/qwen3_235b_a22b_srpo.yaml", 32, 94, 128, 4, 1536),
    ("examples/qwen3_235b_a22b_lora_srpo.yaml", 1, 94, 128, 4, 1536),  # LoRA: the base frozen
    ("examples/glm45_air_srpo.yaml", 8, 46, 128, 8, 1408),
    ("examples/gpt_oss_20b_srpo.yaml", 2, 24, 32, 8, 2880),
]  # DeepSeek-V3 (61 layers on PP4, an engine across nodes): tests/unit/test_planner_families.py


@pytest.fixture(autouse=True)
def _stdin_devnull(monkeypatch):
    # nemo-run's `invoke` steps mirror stdin, which pytest's capture refuses (as in test_launch.py).
    with open(os.devnull) as f:
        monkeypatch.setattr(sys, "stdin", f)
        yield


@pytest.mark.parametrize("recipe, nodes, layers, experts, kv_heads, moe_width", RECIPES)
def test_moe_recipe_layouts_fit_and_dryrun(
    recipe, nodes, layers, experts, kv_heads, moe_width, tmp_path, capsys
):
    cfg = load_config(TrainConfig, REPO / recipe)
    p, world = cfg.parallel, nodes * 8
    assert world % (p.tp * p.pp) == 0 and world % (p.etp * p.ep * p.pp) == 0
    assert layers % p.pp == 0 and experts % p.ep == 0 and kv_heads % p.tp == 0 and moe_width % p.etp == 0
    assert p.sequence_parallel == (p.tp > 1)
    assert cfg.moe == MoEConfig(dispatcher="alltoall", router_dtype="fp32")  # RL defaults: no aux losses
    # The paper's SRPO settings (method §4), as in the 8B recipe.
    dense = load_config(TrainConfig, REPO / "examples/qwen3_8b_srpo.yaml")
    assert (cfg.loss, cfg.optim, cfg.teacher, cfg.train) == (
        dense.loss,
        dense.optim,
        dense.teacher,
        dense.train,
    )
    assert (cfg.rollout.prompts_per_step, cfg.rollout.group_size) == (32, 8)
    args = [
        recipe,
        "--cluster",
        "cluster/h100.yaml",
        "--nodes",
        str(nodes),
        "--dryrun",
        "--home",
        str(tmp_path),
    ]
    assert commands.main(["launch", *args]) == 0
    engine_nodes = cfg.rollout.engine_nodes if cfg.rollout.placement == "separate" else 0
    assert f"#SBATCH --nodes={nodes + engine_nodes}" in capsys.readouterr().out


def test_moe_keys_are_checked(tmp_path):
    recipe = {"base": str(REPO / RECIPES[0][0]), "moe": {"aux_loss_coeff": -0.1}}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(recipe))
    with pytest.raises(ConfigError, match=re.escape("moe.aux_loss_coeff=-0.1")):
        load_config(TrainConfig, path)
    recipe["moe"] = {"router_dtype": "bf16"}
    path.write_text(yaml.safe_dump(recipe))
    with pytest.raises(ConfigError, match="router_dtype"):
        load_config(TrainConfig, path)
