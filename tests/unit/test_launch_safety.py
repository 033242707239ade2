"""`srpo launch` as an attacker would use it: shell metacharacters in names and cluster fields, secrets.

The sbatch script is nemo-run's real one (a dry run); it is then executed by bash with stub ``srun`` /
``scontrol`` on PATH that record what they were given, so a ``$(...)`` that ran would leave a file behind
and a value that was not one literal word would reach ``srun`` changed.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from srpo_megatron.config import ConfigError, load_cluster
from srpo_megatron.launch import commands
from srpo_megatron.launch.experiment import LaunchRequest, srpo_train_command, submit
from srpo_megatron.launch.jobs import set_home

REPO = Path(__file__).resolve().parents[2]
SECRET = "hf_s3cr3t_value_0123456789"
LISTED_SECRET = "listed-credential-value"


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    # nemo-run mirrors stdin into its shell steps (pytest's captured stdin raises on read); every shell
    # step runs in tmp_path so a file an injection created would be found there.
    monkeypatch.chdir(tmp_path)
    with open(os.devnull) as f:
        monkeypatch.setattr(sys, "stdin", f)
        yield


def _evil_cluster(tmp_path: Path, **extra) -> Path:
    pwn = tmp_path / "PWN"
    fields = {
        "name": "evil",
        "executor": "slurm",
        "partition": "debug",
        "container_image": f"img$(touch {pwn}_image)",
        "container_mounts": [f"/a b:/b$(touch {pwn}_mount)"],
        "env": {
            "FOO": f"x$(touch {pwn}_env) `touch {pwn}_tick`; y",
            "HF_TOKEN": SECRET,
            "MY_CRED": LISTED_SECRET,
        },
        "secrets": ["MY_CRED"],
        **extra,
    }
    path = tmp_path / "evil.yaml"
    path.write_text(yaml.safe_dump(fields))
    return path


def _recipe(tmp_path: Path, name: str = "r.yaml") -> Path:
    path = tmp_path / name
    # a whole recipe: `srpo launch` loads it as `srpo train` does (the tiny one under it)
    tiny = Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu_test.yaml"
    data = tmp_path / "train.jsonl"  # launch refuses a missing data file, as train does
    data.write_text('{"prompt": "p", "system": null, "answer": "1", "kind": "coin"}\n')
    path.write_text(
        yaml.safe_dump({"base": str(tiny), "train": {"steps": 1}, "data": {"train_files": [str(data)]}})
    )
    return path


def _pwned(tmp_path: Path) -> list[str]:
    return sorted(str(p) for p in tmp_path.rglob("PWN*"))  # what `touch PWN...` would have created


@pytest.mark.parametrize("name", ["x;touch PWN;#", "$(touch PWN)", "a b", "../up", "x\ntouch PWN"])
def test_unsafe_name_is_refused_before_anything_runs(tmp_path, capsys, name):
    args = ["launch", str(_recipe(tmp_path)), "--cluster", "ci", "--dryrun", "--name", name]
    assert commands.main([*args, "--home", str(tmp_path / "home")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a safe name" in err
    assert _pwned(tmp_path) == [] and not (tmp_path / "home" / "experiments").exists()


def test_recipe_file_named_like_an_injection_runs_nothing(tmp_path, capsys):
    recipe = _recipe(tmp_path, "x;touch PWN;#.yaml")
    assert commands.main(["launch", str(recipe), "--cluster", "ci", "--dryrun", "--home", str(tmp_path)]) == 0
    script = capsys.readouterr().out
    assert _pwned(tmp_path) == []
    assert "#SBATCH --job-name=ci-srpo-x_touch_PWN" in script  # the default name is made safe
    assert shlex.quote(str(recipe)) in script  # the job's argument is the file, as one word


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("mem", "1G\ntouch PWN", "control character"),
        ("account", "a\rb", "control character"),
        ("env", {"A": "x\ny"}, "control character"),
        ("env", {"A B": "1"}, "not a valid environment variable name"),
        ("name", "ev il", "not a safe name"),
        ("secrets", ["NOT_IN_ENV"], "not keys of env"),
    ],
)
def test_bad_cluster_fields_are_refused_at_load(tmp_path, field, value, message):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"name": "c", field: value}))
    with pytest.raises(ConfigError, match=message) as err:
        load_cluster(path)
    assert "\n" not in str(err.value).replace("\\n", "")  # one line (a newline is shown escaped)


def test_unsafe_nemorun_home_is_refused(tmp_path, capsys):
    home = tmp_path / "h;touch PWN"
    assert (
        commands.main(["launch", str(_recipe(tmp_path)), "--cluster", "ci", "--dryrun", "--home", str(home)])
        == 2
    )
    assert "experiment directory" in capsys.readouterr().err and _pwned(tmp_path) == []


def test_dryrun_redacts_secrets(tmp_path, capsys):
    rc = commands.main(
        [
            "launch",
            str(_recipe(tmp_path)),
            "--cluster",
            str(_evil_cluster(tmp_path)),
            "--dryrun",
            "--home",
            str(tmp_path),
        ]
    )
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert SECRET not in out.out + out.err and LISTED_SECRET not in out.out + out.err
    assert "export HF_TOKEN='<redacted>'" in out.out and "export MY_CRED='<redacted>'" in out.out
    assert _pwned(tmp_path) == []


def _script(tmp_path: Path) -> str:
    """The sbatch script with the real secrets (what sbatch would get), from a dry run."""
    set_home(tmp_path / "home")
    request = LaunchRequest(
        "evil-run",
        srpo_train_command(
            str(_recipe(tmp_path)),
            [f"run.dir=/r $(touch {tmp_path}/PWN_arg)", "data.train_files=[/d/a b.jsonl]"],
        ),
    )
    return submit(load_cluster(_evil_cluster(tmp_path)), request, dryrun=True, redact=False).script


def _stub(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(0o755)


def test_generated_script_runs_no_injected_command(tmp_path):
    script = _script(tmp_path)
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "srun_calls"
    # srun records its argv (NUL-separated) and the values of FOO / HF_TOKEN it was started with.
    _stub(
        bin_dir,
        "srun",
        f'if [[ " $* " == *" hostname "* ]]; then echo 127.0.0.1; exit 0; fi\n'
        f'printf "%s\\0" "$@" > {record}\nprintf "%s\\0" "$FOO" "$HF_TOKEN" "$MY_CRED" > {record}.env\n',
    )
    _stub(bin_dir, "scontrol", "echo localhost\n")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "localhost"}
    env.update(SLURM_JOB_ID="1", SLURM_NODEID="0")
    done = subprocess.run(["bash", str(path)], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert _pwned(tmp_path) == [], "a $(...) or `...` in a field was executed"

    argv = record.read_text().split("\0")[:-1]
    assert argv[argv.index("--container-image") + 1] == f"img$(touch {tmp_path}/PWN_image)"
    mounts = argv[argv.index("--container-mounts") + 1].split(",")
    assert mounts[0] == f"/a b:/b$(touch {tmp_path}/PWN_mount)"
    # Slurm: bash parses the quoted srun line, so every override reaches the job verbatim.
    assert argv[argv.index("train") + 2 :] == [
        "--override",
        f"run.dir=/r $(touch {tmp_path}/PWN_arg)",
        "--override",
        "data.train_files=[/d/a b.jsonl]",
    ]
    foo, token, cred = record.with_suffix(".env").read_text().split("\0")[:3]
    assert foo == f"x$(touch {tmp_path}/PWN_env) `touch {tmp_path}/PWN_tick`; y"
    assert (token, cred) == (SECRET, LISTED_SECRET)  # the job gets its secrets ...
    log = done.stdout + done.stderr  # what Slurm would write to the job's log (set -evx echoes)
    assert "export FOO=" in log, "the script's tracing is expected to echo ordinary exports"
    assert SECRET not in log and LISTED_SECRET not in log  # ... and never echoes them


def test_nemo_run_still_leaves_srun_arguments_unquoted():
    """The shim in experiment.build_executor quotes image and mounts because nemo-run 0.11 does not.

    When nemo-run quotes them itself this fails: then remove the shim (it would quote twice).
    """
    from nemo_run.core.execution import slurm

    assert slurm.noquote is str
