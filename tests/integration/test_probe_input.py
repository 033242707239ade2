"""Issue 30's probe commands for rewards and bad input, replayed through the real CLI: each ends in the
trusted behaviour (one line on stderr naming the file, key or target and the fix, exit status 2), where
the probe saw rc 0 and silence, a traceback, or a late error.

In-process (``cli.main``) where the error comes before torch.distributed starts (the recipe, the model's
config.json, the launch checks); a subprocess where it comes after (data, reward targets, a step).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from srpo_megatron import cli
from srpo_megatron.launch import commands

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "examples" / "tiny_cpu_test.yaml"
SECRETS = {
    "DB_PASSWD": "pw-value-1",
    "MYSQL_PWD": "pw-value-2",
    "GITHUB_PAT": "pat-value-3",
    "AWS_CREDENTIALS": "cred-value-4",
    "WANDB_AUTH": "auth-value-5",
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from srpo_megatron.testing.tiny import write_tiny_run

    return write_tiny_run(tmp_path_factory.mktemp("tiny"), num_prompts=4)


@pytest.fixture
def mods(tmp_path) -> Path:
    """A reward module on the subprocesses' path: ``boom`` raises on every sample."""
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "probe_rewards.py").write_text(
        "def boom(response, answer):\n    raise ValueError('gold answer unparsable')\n"
    )
    return mods


def _overrides(tiny, tmp_path: Path, *extra: str) -> list[str]:
    _, hf, rows = tiny
    base = [f"model.hf_dir={hf}", f"data.train_files=[{rows}]", f"run.dir={tmp_path / 'run'}", *extra]
    return [a for o in base for a in ("--override", o)]


def _one_line(err: str, command: str = "train") -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"srpo {command}: error: "), err
    return lines[0]


def _srpo_train(tiny, tmp_path: Path, mods: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{mods}", "PYTHONWARNINGS": "ignore"}
    argv = [
        sys.executable,
        "-m",
        "srpo_megatron.cli",
        "train",
        str(RECIPE),
        *_overrides(tiny, tmp_path, *extra),
    ]
    return subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)


def test_a_reward_failing_on_every_sample_stops_the_run_in_one_line(tiny, tmp_path, mods):
    """Probe: a reward that raises on every sample ran to rc 0, printing nothing (reward/errors 16)."""
    done = _srpo_train(tiny, tmp_path, mods, "rollout.reward_fns={coin: probe_rewards:boom}", "train.steps=1")
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert last.startswith(
        "srpo train: error: every reward of step 1 failed (16 of 16; first: reward 'coin' "
    )
    assert "(probe_rewards:boom): ValueError: gold answer unparsable" in last, last
    assert "rollout.allow_reward_errors" in last
    assert "raised on a dummy input (ValueError: gold answer unparsable)" in done.stdout  # the start-up note


def test_reward_target_os_system_is_refused_at_start(tiny, tmp_path, mods):
    """Probe: ``rollout.reward_fns={coin: 'os:system'}`` passed the start-up check (the dummy call's
    exception was swallowed, the signature never checked). (The empty data file, named now, is
    tests/unit/test_loud_inputs.py: a second subprocess here would cost as much as this one.)"""
    done = _srpo_train(tiny, tmp_path, mods, "rollout.reward_fns={coin: 'os:system'}")
    last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert last.startswith("srpo train: error: reward target 'os:system': it is not a reward function"), last
    assert "does not take (response, answer)" in last


def _train_rc(tiny, tmp_path, capsys, *extra: str, recipe: Path = RECIPE) -> str:
    rc = cli.main(["train", str(recipe), *_overrides(tiny, tmp_path, *extra)])
    err = capsys.readouterr().err
    assert rc == 2, err
    return _one_line(err)


def test_model_inputs_are_refused_before_the_model_loads(tiny, tmp_path, capsys):
    """Probe: top_k above the vocabulary failed after the first rollout; max_sequence_length below the
    budget or above max_position_embeddings was accepted; a broken config.json was a traceback."""
    _, hf, _ = tiny
    vocab = json.loads((hf / "config.json").read_text())["vocab_size"]
    line = _train_rc(tiny, tmp_path, capsys, f"loss.top_k={vocab + 1}")
    assert f"loss.top_k={vocab + 1} is larger than the vocabulary" in line
    line = _train_rc(tiny, tmp_path, capsys, "model.max_sequence_length=64")
    assert "model.max_sequence_length=64 is below data.max_prompt_tokens + rollout.max_new_tokens" in line
    line = _train_rc(tiny, tmp_path, capsys, "model.max_sequence_length=4096")
    assert "model.max_sequence_length=4096 is above the max_position_embeddings=1024" in line
    broken = tmp_path / "broken_model"
    broken.mkdir()
    (broken / "config.json").write_text((hf / "config.json").read_text()[:-20])
    line = _train_rc(tiny, tmp_path, capsys, f"model.hf_dir={broken}")
    assert f"{broken}/config.json: the model's config.json is not valid JSON" in line


def test_a_duplicate_top_level_key_is_refused_naming_key_and_line(tiny, tmp_path, capsys):
    """Probe: a second ``rollout:`` section silently replaced the first one."""
    recipe = tmp_path / "dup.yaml"
    recipe.write_text(
        f"base: {RECIPE}\nrollout:\n  group_size: 4\ntrain:\n  steps: 1\nrollout:\n  top_p: 0.9\n"
    )
    line = _train_rc(tiny, tmp_path, capsys, recipe=recipe)
    assert f"{recipe}:6: key 'rollout' appears twice, on line 2 and line 6" in line


def _launch(tmp_path: Path, recipe: Path, cluster: str, *flags: str) -> int:
    return commands.main(["launch", str(recipe), "--cluster", cluster, *flags, "--home", str(tmp_path / "h")])


@pytest.fixture
def _no_stdin(monkeypatch):
    with open(os.devnull) as f:  # nemo-run mirrors stdin into its shell steps; pytest's raises on read
        monkeypatch.setattr(sys, "stdin", f)
        yield


def test_launch_refuses_a_missing_data_file_before_submitting(tmp_path, capsys, _no_stdin):
    """Probe: `srpo launch` submitted a recipe whose data file does not exist (the doctor step in the job
    caught it after the allocation); --dryrun and a real local launch now refuse it in one line."""
    recipe = tmp_path / "r.yaml"
    missing = tmp_path / "data" / "nope.jsonl"
    recipe.write_text(yaml.safe_dump({"base": str(RECIPE), "data": {"train_files": [str(missing)]}}))
    for cluster, flags in (("ci", ["--dryrun"]), ("cluster/local.yaml", [])):
        assert _launch(tmp_path, recipe, cluster, *flags) == 2
        line = _one_line(capsys.readouterr().err, "launch")
        assert f"data file {missing} does not exist" in line, line
    assert not list((tmp_path / "h").glob("experiments/*"))  # nothing was submitted


def test_launch_dryrun_redacts_more_credential_names_and_keeps_path(tmp_path, capsys, _no_stdin):
    """Probe: *PASSWD*, *PWD*, *PAT*, *CRED*, *AUTH* were printed by --dryrun and echoed into the log."""
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "p", "system": null, "answer": "1", "kind": "coin"}\n')
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"base": str(RECIPE), "data": {"train_files": [str(data)]}}))
    env = {**SECRETS, "PATH": "/opt/visible/bin:$PATH", "DATA_PATH": "/visible/data"}
    cluster = tmp_path / "c.yaml"
    cluster.write_text(yaml.safe_dump({"name": "c", "executor": "slurm", "partition": "p", "env": env}))
    assert _launch(tmp_path, recipe, str(cluster), "--dryrun") == 0
    out = capsys.readouterr().out
    leaked = [k for k, v in SECRETS.items() if v in out]
    assert not leaked, f"printed by --dryrun: {leaked}"
    assert all(f"export {k}='<redacted>'" in out for k in SECRETS), out
    assert "/opt/visible/bin" in out and "/visible/data" in out  # PATH and *_PATH are not secrets
