"""What a new user sees from ``srpo train`` on CPU: megatron-core's Transformer Engine / Apex fallback
warnings are replaced by one line saying what runs instead, and a checkpoint save says nothing about an
"old incomplete / corrupted checkpoint" (``srpo_megatron/compat/fallbacks.py``,
``trainer/run/checkpoint.py``).

The planted variant: the same imports without the filter print megatron's fallback warnings, so the
counts below can fail."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from srpo_megatron.testing.tiny import write_tiny_run
from tests.helpers.recipe import RECIPE, REPO, tiny_overrides

NOTICE = "megatron-core: Transformer Engine and Apex not installed (expected on CPU)"
FALLBACKS = ("Transformer Engine and Apex are not installed", "Apex is not installed. Falling back")
OVERWRITING = "Overwriting old incomplete / corrupted checkpoint"


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("PYTHONWARNINGS", None)  # python's default filters, as a user's shell has them
    return env


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_run(tmp_path_factory.mktemp("tiny"), num_prompts=4)


def test_srpo_train_prints_the_notice_once_and_no_megatron_fallback_warning(tiny, tmp_path):
    overrides = tiny_overrides(
        tiny, tmp_path / "run", ["train.steps=1", "run.save_every=1", "train.eval_at_ends=false"]
    )
    argv = [sys.executable, "-m", "srpo_megatron.cli", "train", str(RECIPE)]
    for o in overrides:
        argv += ["--override", o]
    done = subprocess.run(argv, capture_output=True, text=True, env=_env(), cwd=REPO, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert out.count(NOTICE) == 1, out[-3000:]
    for message in (*FALLBACKS, OVERWRITING):
        assert message not in out, f"{message!r} printed:\n{out[-3000:]}"


def test_without_the_filter_megatron_prints_its_fallback_warnings():
    code = "import srpo_megatron.train"  # the imports srpo train makes, without cli.main's filter
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_env(), cwd=REPO, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert sum(done.stderr.count(m) for m in FALLBACKS) >= 5, done.stderr[-3000:]
