"""`srpo plan` models only keys `srpo train` accepts: it reads the typed TrainConfig, checked across every
example recipe by recording each attribute the planner reads."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from srpo_megatron.config import ConfigError, load_recipe, to_dict
from srpo_megatron.planner import command
from srpo_megatron.planner.memory import GiB

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
RECIPES = sorted(EXAMPLES.glob("*.yaml"))


class Recorder:
    """Wraps a config dataclass; every attribute read is recorded as its dotted recipe path."""

    def __init__(self, obj, path: str, seen: set[str]):
        self._obj, self._path, self._seen = obj, path, seen

    def __getattr__(self, name: str):
        path = f"{self._path}.{name}" if self._path else name
        self._seen.add(path)
        value = getattr(self._obj, name)
        return Recorder(value, path, self._seen) if dataclasses.is_dataclass(value) else value


def _recipe_keys(data, prefix: str = "") -> set[str]:
    keys = set()
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else key
        keys.add(path)
        if isinstance(value, dict) and key != "engine_kwargs" and key != "reward_fns":
            keys |= _recipe_keys(value, path)
    return keys


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_key_the_planner_reads_is_a_key_the_trainer_accepts(recipe, monkeypatch):
    cfg = load_recipe(recipe)
    try:
        command.resolve_hf_config(cfg.model.hf_dir)
    except ConfigError:  # the CPU recipes' tiny models are not on this machine: plan a packaged shape
        packaged = command.resolve_hf_config("/models/Qwen3-8B")
        monkeypatch.setattr(command, "resolve_hf_config", lambda hf_dir: packaged)
    seen: set[str] = set()
    par = cfg.parallel
    gpus = par.tp * par.pp * par.cp * 8
    command.settings_from_recipe(Recorder(cfg, "", seen), gpus, 8, int(80 * GiB))
    accepted = _recipe_keys(to_dict(cfg))
    assert seen, "the planner read nothing"
    assert seen <= accepted, f"{recipe.name}: the planner reads {sorted(seen - accepted)}, not recipe keys"
    assert "parallel.optimizer_offload" not in seen


def test_the_recorder_catches_a_key_the_trainer_does_not_have():
    """A planted shadow key (what the old planner read): reading it through the recorder is recorded
    and refused by the same subset check."""
    cfg = load_recipe(EXAMPLES / "qwen3_8b_srpo.yaml")
    seen: set[str] = set()
    rec = Recorder(cfg, "", seen)
    assert getattr(rec.parallel, "optimizer_offload", False) is False
    assert not seen <= _recipe_keys(to_dict(cfg))
