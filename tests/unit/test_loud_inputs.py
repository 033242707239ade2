"""Issue 30, "nothing silent" (unit level): rewards that fail loudly, reward targets checked before they
are called, and recipe inputs refused in one line before the model loads.

- a reward returning the string ``"1.0"`` is an error (reward 0, counted), not 1.0;
- ``os:system`` as a reward target is refused at start (its signature does not take (response, answer)),
  and a dummy call that raises is reported as a note instead of being swallowed;
- a step with more than half of its rewards failed warns with the kind, target and first messages; a
  step with all of them failed stops, unless ``rollout.allow_reward_errors``;
- a duplicate YAML key is refused naming the key and its lines; an empty data file is named;
- ``loss.top_k`` above the vocabulary, ``model.max_sequence_length`` below the rollout budget or above
  ``max_position_embeddings``, and a broken ``config.json`` are one-line ConfigErrors;
- launch's secret patterns cover PASSWD / PWD / PAT / CRED / AUTH without hiding PATH or the shell's PWD;
- launch looks a data file up at its container mount's source.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from srpo_megatron.config import ConfigError, LossConfig
from srpo_megatron.config.loading import load_yaml
from srpo_megatron.data.rows import DataError, load_rows
from srpo_megatron.launch.data_files import host_path
from srpo_megatron.launch.shell_safety import is_secret
from srpo_megatron.rewards import RewardPool, register_reward
from srpo_megatron.trainer.collect.reward_errors import RewardsFailed, check_step_rewards
from srpo_megatron.trainer.collect.sample_pool import CompletedGroup
from srpo_megatron.trainer.run.preflight import check_model_limits, read_model_config
from tests.helpers.sample_pool import G, completion, make_pool, prompt


def stringly_reward(response: str, answer: str) -> object:
    return "1.0"


def raising_reward(response: str, answer: str) -> float:
    raise ValueError(f"cannot parse {answer!r}")


register_reward("test_stringly", stringly_reward)
register_reward("test_raising", raising_reward)
TARGET = f"{__name__}:raising_reward"


# ---- rewards ------------------------------------------------------------------------------------------


def test_a_reward_returning_a_string_is_an_error_not_a_reward():
    with RewardPool(0, timeout_s=30) as pool:  # worker processes: the "invalid" answer, checked below
        res = pool.score(["test_stringly", "arithmetic"], ["x", "7"], ["x", "7"])
    assert res.rewards == [0.0, 1.0] and res.num_errors == 1, res
    assert "reward 'test_stringly'" in res.errors[0] and "'1.0' (str), not a number" in res.errors[0]


@pytest.mark.parametrize("workers", [0, 1])
def test_os_system_is_refused_at_start_and_a_raising_dummy_call_is_a_note(workers):
    notes: list[str] = []
    with RewardPool(workers, timeout_s=30, import_timeout_s=120) as pool:
        problem = pool.check_targets(["os:system"], notes=notes)
        assert problem is not None and "reward target 'os:system': it is not a reward function" in problem
        assert "does not take (response, answer)" in problem, problem
        assert pool.check_targets([f"{__name__}:stringly_reward"]) is not None  # "1.0" refused at start
        assert pool.check_targets([TARGET], notes=notes) is None  # raising on "" is allowed ...
    assert len(notes) == 1 and TARGET in notes[0] and "ValueError: cannot parse '0'" in notes[0]  # ... said


def test_a_step_with_most_rewards_failed_warns_and_one_with_all_failed_stops():
    lines: list[str] = []
    msgs = ["reward 'coin' (m:f): ValueError: a"] * 5 + ["reward 'coin' (m:f): KeyError: b"]
    check_step_rewards(3, 16, 8, msgs, False, lines.append)
    assert lines == []  # half is not more than half
    check_step_rewards(3, 16, 9, msgs, False, lines.append)
    assert len(lines) == 1 and "9 of 16 rewards of step 3 failed" in lines[0]
    assert lines[0].count("ValueError: a") == 1 and "KeyError: b" in lines[0]  # first distinct messages
    with pytest.raises(
        RewardsFailed, match=r"every reward of step 3 failed \(16 of 16; first: reward 'coin'"
    ):
        check_step_rewards(3, 16, 16, msgs, False, lines.append)
    check_step_rewards(3, 16, 16, msgs, True, lines.append)  # rollout.allow_reward_errors: warn only
    assert len(lines) == 2 and "16 of 16" in lines[1]


def _groups(kind: str, n: int = 2) -> list[CompletedGroup]:
    return [
        CompletedGroup(prompt(i, kind), [completion(1.0, f"i{i}m{m}") for m in range(G)], 0, i)
        for i in range(n)
    ]


def test_sample_pool_stops_when_every_reward_of_the_step_failed(capsys):
    with RewardPool(0, 30.0) as rewards:
        pool = make_pool(rewards)
        pool.add(_groups("test_raising"))
        with pytest.raises(RewardsFailed, match=r"every reward of step 1 failed \(8 of 8"):
            pool.take(2, 0, 0, step=1)
        allowed = make_pool(rewards, allow_reward_errors=True)
        allowed.add(_groups("test_raising"))
        batch = allowed.take(2, 0, 0, step=1)
    assert batch is not None and batch.metrics["reward/errors"] == 8.0
    out = capsys.readouterr().out
    assert "8 of 8 rewards of step 1 failed" in out and f"reward 'test_raising' ({TARGET})" in out


# ---- recipe and input checks --------------------------------------------------------------------------


def test_a_duplicate_yaml_key_is_refused_with_its_lines(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  hf_dir: /m\ndata:\n  train_files: [a]\nmodel:\n  max_sequence_length: 64\n")
    with pytest.raises(ConfigError, match=r"r\.yaml:5: key 'model' appears twice, on line 1 and line 5"):
        load_yaml(recipe)
    recipe.write_text("rollout:\n  top_k: 3\n  top_p: 0.5\n  top_k: 4\n")  # nested too
    with pytest.raises(ConfigError, match="key 'top_k' appears twice, on line 2 and line 4"):
        load_yaml(recipe)
    recipe.write_text("a: &x {p: 1, q: 2}\nb:\n  <<: *x\n  p: 3\n")  # a merge key's keys may be overridden
    assert load_yaml(recipe)["b"] == {"p": 3, "q": 2}


def test_an_empty_data_file_is_named(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match=rf"^{empty}: data file is empty"):
        load_rows(empty)


def _cfg(top_k=8, seq=256, prompt_tokens=128, new=8) -> SimpleNamespace:
    return SimpleNamespace(
        model=SimpleNamespace(hf_dir="/models/tiny", max_sequence_length=seq),
        loss=LossConfig(top_k=top_k),
        data=SimpleNamespace(max_prompt_tokens=prompt_tokens),
        rollout=SimpleNamespace(max_new_tokens=new),
    )


HF = {"vocab_size": 100, "max_position_embeddings": 1024}


@pytest.mark.parametrize(
    ("cfg", "words"),
    [
        (_cfg(top_k=101), "loss.top_k=101 is larger than the vocabulary of model.hf_dir /models/tiny (100"),
        (_cfg(seq=100), "model.max_sequence_length=100 is below data.max_prompt_tokens + rollout.max_new"),
        (_cfg(seq=2048), "model.max_sequence_length=2048 is above the max_position_embeddings=1024"),
    ],
)
def test_model_limits_are_refused_before_the_model_loads(cfg, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(".", r"\.").replace("+", r"\+")):
        check_model_limits(cfg, HF)


def test_model_limits_that_fit_pass():
    check_model_limits(_cfg(top_k=100, seq=1024, prompt_tokens=1000, new=24), HF)


def test_a_broken_config_json_is_one_line_naming_it(tmp_path):
    (tmp_path / "config.json").write_text('{"vocab_size": 100,')
    with pytest.raises(
        ConfigError, match=rf"^{tmp_path}/config\.json: the model's config\.json is not valid"
    ):
        read_model_config(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(HF))
    assert read_model_config(str(tmp_path)) == HF


# ---- launch -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key",
    ["DB_PASSWD", "MYSQL_PWD", "GITHUB_PAT", "GH_PAT_RO", "AWS_CREDENTIALS", "WANDB_AUTH", "AUTHORIZATION"],
)
def test_more_credential_names_are_secrets(key):
    assert is_secret(key)


@pytest.mark.parametrize(
    "key", ["PATH", "PYTHONPATH", "LD_LIBRARY_PATH", "PWD", "OLDPWD", "HOME", "DISPATCH"]
)
def test_path_and_the_shells_pwd_stay_visible(key):
    assert not is_secret(key)


def test_launch_looks_data_up_at_the_container_mounts_source():
    mounts = ["/lustre/d:/data", "/lustre/d/big:/data/big", "/scratch"]
    assert host_path(Path("/data/x.jsonl"), mounts) == Path("/lustre/d/x.jsonl")
    assert host_path(Path("/data/big/y.jsonl"), mounts) == Path("/lustre/d/big/y.jsonl")  # longest wins
    assert host_path(Path("/database/z.jsonl"), mounts) == Path("/database/z.jsonl")  # not under /data


@pytest.mark.parametrize("command", ["train", "eval", "launch"])
def test_help_says_reward_targets_and_checkpoints_are_code_that_runs(command):
    from srpo_megatron.cli import build_parser

    parser = build_parser([command])
    sub = parser._subparsers._group_actions[0].choices[command]  # type: ignore[union-attr]
    text = " ".join(sub.format_help().split())
    assert "reward targets (rollout.reward_fns, 'package.module:function') are code that runs" in text
    assert "loading a crafted one runs code" in text
