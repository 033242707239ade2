"""Every bad input a user can give `srpo train` ends in one line on stderr naming it, with exit status 2.

Table-driven: recipe and override errors are checked in-process (they fail before anything loads);
those that need the tokenizer, the data or the reward pool run the real ``python -m srpo_megatron.cli
train`` in a subprocess (they fail after torch.distributed is up, before the model loads).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from srpo_megatron import cli

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "examples" / "tiny_cpu_test.yaml"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from srpo_megatron.testing.tiny import write_tiny_run

    return write_tiny_run(tmp_path_factory.mktemp("tiny"), num_prompts=4)


def _base(tiny, tmp_path: Path, data: Path | None = None) -> list[str]:
    _, hf, rows = tiny
    return [f"model.hf_dir={hf}", f"data.train_files=[{data or rows}]", f"run.dir={tmp_path / 'run'}"]


def _argv(recipe: Path, overrides: list[str]) -> list[str]:
    return ["train", str(recipe), *(a for o in overrides for a in ("--override", o))]


# (case, overrides, words the one-line error must contain)
CONFIG_CASES = [
    ("override is not YAML", ["x=["], "not valid YAML"),
    ("reward_workers negative", ["rollout.reward_workers=-3"], "rollout.reward_workers=-3"),
    ("reward_timeout_s zero", ["rollout.reward_timeout_s=0"], "rollout.reward_timeout_s=0.0"),
    ("lr NaN", ["optim.lr=.nan"], "optim.lr: nan is not a finite number"),
    ("lr inf", ["optim.lr=inf"], "optim.lr: 'inf' is not a finite number"),
    ("lr negative", ["optim.lr=-1"], "lr=-1.0 must be > 0"),
    ("temperature NaN", ["rollout.temperature=.nan"], "is not a finite number"),
    ("temperature zero", ["rollout.temperature=0"], "temperature"),
    ("loss temperature", ["loss.temperature=0.7"], "loss.temperature is not a recipe key"),
    ("beta1 >= 1", ["optim.adam_beta1=1.0"], "optim.adam_beta1=1.0 must be in [0, 1)"),
    ("beta2 negative", ["optim.adam_beta2=-0.1"], "optim.adam_beta2=-0.1 must be in [0, 1)"),
    ("max_new_tokens zero", ["rollout.max_new_tokens=0"], "max_new_tokens=0"),
    ("max_sequence_length zero", ["model.max_sequence_length=0"], "model.max_sequence_length=0"),
    ("prompt length too small", ["data.max_prompt_tokens=-5"], "data.max_prompt_tokens=-5"),
    ("reward target malformed", ["rollout.reward_fns={coin: nocolon}"], "'package.module:function'"),
    ("unknown key", ["optim.learning_rate=1"], "unknown key(s) ['learning_rate']"),
    ("TP larger than the world", ["parallel.tp=2"], "1 processes cannot be split into parallel.tp=2"),
]


@pytest.mark.parametrize(("case", "overrides", "words"), CONFIG_CASES, ids=[c[0] for c in CONFIG_CASES])
def test_bad_recipe_values_one_line_exit_2(tiny, tmp_path, capsys, case, overrides, words):
    rc = cli.main(_argv(RECIPE, [*_base(tiny, tmp_path), *overrides]))
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.count("\n") == 1 and err.startswith("srpo train: error: "), err
    assert words in err, err


def test_recipe_with_non_utf8_bytes_one_line_exit_2(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_bytes(RECIPE.read_bytes() + b"# caf\xe9\n")
    assert cli.main(["train", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{recipe}: byte" in err and "is not UTF-8" in err, err


def _write_rows(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


def _good_row(i: int) -> bytes:
    return json.dumps({"prompt": f"Say {i}.", "system": None, "answer": "-", "kind": "coin"}).encode()


def _run_cases(tmp_path: Path) -> list[tuple[str, list[str], str]]:
    hang = tmp_path / "mods" / "hanging_reward.py"
    hang.parent.mkdir()
    hang.write_text("import time\ntime.sleep(3600)\n\ndef reward(response, answer):\n    return 1.0\n")
    data = tmp_path / "data"
    data.mkdir()
    missing = _write_rows(data / "missing.jsonl", [_good_row(0), b'{"prompt": "x", "kind": "coin"}'])
    latin1 = _write_rows(data / "latin1.jsonl", [_good_row(0), _good_row(1)[:-2] + b'\xe9"}'])
    return [
        (
            "reward target typo with reward workers",
            ["rollout.reward_workers=1", "rollout.reward_fns={coin: srpo_megatron.testing.tiny:coin_rewrad}"],
            "reward target 'srpo_megatron.testing.tiny:coin_rewrad': cannot import it (AttributeError",
        ),
        (
            "reward module whose import hangs",
            ["rollout.reward_fns={coin: hanging_reward:reward}", "rollout.reward_import_timeout_s=3"],
            "reward target 'hanging_reward:reward': its import did not finish",
        ),
        (
            "data row without answer",
            [f"data.train_files=[{missing}]"],
            f"{missing}:2: field 'answer' is missing",
        ),
        ("data row not UTF-8", [f"data.train_files=[{latin1}]"], f"{latin1}:2: not UTF-8 text"),
    ]


def test_bad_inputs_found_at_startup_one_line_exit_2(tiny, tmp_path):
    """The real CLI in a subprocess: the last stderr line is the error, and there is no traceback."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{tmp_path / 'mods'}", "PYTHONWARNINGS": "ignore"}
    failures = []
    for case, overrides, words in _run_cases(tmp_path):
        argv = _argv(RECIPE, [*_base(tiny, tmp_path), *overrides])
        done = subprocess.run(
            [sys.executable, "-m", "srpo_megatron.cli", *argv],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=300,
        )
        last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""
        ok = done.returncode == 2 and "Traceback" not in done.stderr and words in last
        if not ok or not last.startswith("srpo train: error: "):
            failures.append(f"{case}: rc={done.returncode} stderr tail={done.stderr[-1500:]!r}")
    assert not failures, "\n".join(failures)
