"""One recipe, one verdict: `srpo train`, `srpo plan` and `srpo launch --dryrun` load it the same way
(config.load_recipe), so a bad key fails all three with the same message and exit status 2; and the two
login-node commands, plan and launch --dryrun, never import torch (run as real subprocesses)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "tiny_cpu_test.yaml"
QWEN = REPO / "examples" / "qwen3_8b_srpo.yaml"
# Runs the CLI as `python -m srpo_megatron.cli ...` and, at exit, writes the imported modules to a file.
WRAPPER = (
    "import atexit, json, runpy, sys\n"
    "out = sys.argv.pop(1)\n"
    "atexit.register(lambda: open(out, 'w').write(json.dumps(sorted(sys.modules))))\n"
    "sys.argv[0] = 'srpo'\n"
    "runpy.run_module('srpo_megatron.cli', run_name='__main__', alter_sys=True)\n"
)
HEAVY = ("torch", "transformers", "megatron", "sglang")


def _srpo(args: list[str], tmp_path: Path) -> tuple[int, str, list[str]]:
    """(exit status, stderr, imported top-level modules) of ``srpo ARGS`` in a fresh interpreter."""
    modules = tmp_path / f"modules_{args[0]}.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-c", WRAPPER, str(modules), *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        stdin=subprocess.DEVNULL,
        timeout=600,
    )
    imported = json.loads(modules.read_text()) if modules.is_file() else []
    return proc.returncode, proc.stderr, sorted({m.split(".")[0] for m in imported})


def _commands(recipe: Path, home: Path) -> dict[str, list[str]]:
    return {
        "train": ["train", str(recipe)],
        "plan": ["plan", str(recipe), "--cluster", "h100", "--nodes", "4"],
        "launch": ["launch", str(recipe), "--cluster", "local", "--dryrun", "--home", str(home)],
    }


BAD = {
    "unknown key": ("optim: {learning_rate: 1.0e-6}\n", "unknown key(s) ['learning_rate']"),
    # the planner once planned this key, which the trainer never had
    "key the trainer refuses": (
        "parallel: {optimizer_offload: true}\n",
        "unknown key(s) ['optimizer_offload']",
    ),
    "value the trainer refuses": (
        "parallel: {teacher_fp32: none}\n",
        "parallel.teacher_fp32: 'none' is not valid",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_recipe_fails_train_plan_and_launch_the_same_way(case, tmp_path):
    text, words = BAD[case]
    recipe = tmp_path / "bad.yaml"
    recipe.write_text(f"base: {QWEN}\n{text}\n")
    errors = {}
    for name, args in _commands(recipe, tmp_path / "home").items():
        rc, err, _ = _srpo(args, tmp_path)
        assert rc == 2, f"srpo {name}: exit {rc}\n{err}"
        prefix = f"srpo {name}: error: "
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(prefix), f"srpo {name}:\n{err}"
        errors[name] = lines[0][len(prefix) :]
    assert words in errors["train"], errors["train"]
    assert errors["plan"] == errors["train"] and errors["launch"] == errors["train"], errors


def test_plan_and_launch_dryrun_import_no_torch(tmp_path):
    home = tmp_path / "home"
    plan = ["plan", str(QWEN), "--cluster", "h100", "--nodes", "4", "--json"]
    data = tmp_path / "train.jsonl"  # launch refuses a missing data file, as train does
    data.write_text('{"prompt": "p", "system": null, "answer": "1", "kind": "coin"}\n')
    launch = ["launch", str(TINY), "--cluster", "local", "--dryrun", "--home", str(home)]
    launch += ["--override", f"data.train_files=[{data}]"]
    for args in (plan, launch):
        rc, err, imported = _srpo(args, tmp_path)
        assert rc == 0, err
        heavy = [m for m in HEAVY if m in imported]
        assert not heavy, f"srpo {args[0]} imported {heavy}"
    assert "nemo_run" in imported  # the dry run did build the nemo-run experiment
