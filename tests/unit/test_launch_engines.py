"""`srpo launch --dryrun` of the rollout engines: the colocated plan of the 8B recipe, and a separate
placement job whose generated sbatch script is *executed* with stand-ins for ``srun``/``scontrol`` (each
call is logged with the job's ``SRPO_ENGINE_URLS``), so the test sees which steps the script really
starts, on which nodes, with which engine addresses."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from srpo_megatron import cli

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("NEMORUN_HOME", str(tmp_path / "nemorun"))
    monkeypatch.chdir(REPO)
    # nemo-run's `invoke` mirrors stdin into its shell steps; pytest's captured stdin raises on read
    with open(os.devnull) as f:
        monkeypatch.setattr(sys, "stdin", f)
        yield


def _dryrun(capsys, recipe: str, nodes: int) -> str:
    argv = ["launch", recipe, "--cluster", "cluster/h100.yaml", "--nodes", str(nodes), "--dryrun"]
    assert cli.main(argv) == 0
    return capsys.readouterr().out


def test_qwen3_8b_dryrun_plans_8_engines_of_tp4_on_32_gpus(capsys):
    out = _dryrun(capsys, "examples/qwen3_8b_srpo.yaml", 4)
    assert "# rollout: 8 engines of TP4 (4 GPUs each) colocated on the 32 training GPUs" in out
    assert "export SRPO_ROLLOUT_ENGINES=8" in out
    assert "--nnodes 4 --nproc-per-node 8" in out
    assert "sglang.servers" not in out, "colocated: the trainer ranks host the engines, no server step"


def _fake(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_separate_example_starts_one_server_per_engine_on_its_engine_node(capsys, tmp_path):
    out = _dryrun(capsys, "examples/qwen3_8b_srpo_separate.yaml", 2)
    assert "# rollout: 4 engines of TP2 (2 GPUs each) on 1 engine node(s) (8 GPUs)" in out
    script = out[out.index("#!/bin/bash") :]
    assert "#SBATCH --nodes=3" in script  # 2 training + 1 engine node
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    _fake(bin_dir, "srun", 'echo "URLS=$SRPO_ENGINE_URLS ARGS=$*" >> "$CALLS"\necho 10.0.0.1\n')
    _fake(bin_dir, "scontrol", '[ "$1 $2" = "show hostnames" ] && printf "gpu1\\ngpu2\\ngpu3\\n"\n')
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(log)}
    env.update(SLURM_JOB_NODELIST="gpu[1-3]", SLURM_JOB_ID="42")
    run = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    for _ in range(100):  # the engine step runs in the background; the stand-in returns at once
        calls = log.read_text().splitlines()
        if len(calls) >= 4:
            break
        subprocess.run(["sleep", "0.1"])
    urls = ",".join(f"http://gpu3:{30000 + i}" for i in range(4))
    (engines,) = [c for c in calls if "srpo_megatron.rollout.sglang.servers" in c]
    (train,) = [c for c in calls if " torchrun " in c]
    (doctor,) = [c for c in calls if "srpo_megatron.cli doctor" in c]
    assert f"URLS={urls} " in engines and f"URLS={urls} " in train, "the job exports every server's URL"
    assert "--nodes=1 --relative=2 --ntasks-per-node=1" in engines, "servers on the third (engine) node"
    assert "--container-image /lustre/fsw/my_account/images/srpo_megatron.sqsh" in engines
    assert engines.endswith("servers examples/qwen3_8b_srpo_separate.yaml")
    assert "/engines_%j_%n.out" in engines, "engine logs next to the training log"
    assert "--nodes=2 --relative=0" in train and "--nnodes 2 --nproc-per-node 8" in train
    assert "--nodes=2 --relative=0" in doctor, "the doctor checks the training nodes"
