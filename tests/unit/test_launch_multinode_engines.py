"""Separate placement with an SGLang engine larger than a node (bf16 DeepSeek-V3: TP32 on 8-GPU nodes).

Each engine takes ``tp_size / gpus_per_node`` whole engine nodes; every node runs
``sglang.launch_server --nnodes S --node-rank R --dist-init-addr FIRST:PORT`` and only the engine's first
node (node rank 0, the one that serves HTTP) is listed in ``SRPO_ENGINE_URLS``. Checked here: the refusals,
the URL list, each node's command line (SGLang's own parser reads it in tests/sglang_real), and the
sbatch script of `srpo launch --dryrun examples/deepseek_v3_srpo.yaml` *executed* with stand-ins for
``srun``/``scontrol``, whose engine step is then replayed node by node (``servers --print``).
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from srpo_megatron import cli
from srpo_megatron.config import ConfigError
from srpo_megatron.rollout.sglang import servers
from srpo_megatron.rollout.sglang.servers import (
    DIST_INIT_PORT,
    node_part,
    nodes_per_engine,
    recipe_rollout_config,
    server_commands,
    server_urls,
)

REPO = Path(__file__).resolve().parents[2]
RECIPE = "examples/deepseek_v3_srpo.yaml"  # rollout.engine_nodes 4, tp_size 32


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("NEMORUN_HOME", str(tmp_path / "nemorun"))
    monkeypatch.chdir(REPO)
    monkeypatch.delenv("SRPO_ENGINE_HOSTS", raising=False)
    monkeypatch.delenv("SLURM_PROCID", raising=False)
    with open(os.devnull) as f:  # nemo-run's `invoke` mirrors stdin; pytest's captured stdin raises
        monkeypatch.setattr(sys, "stdin", f)
        yield


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_an_engine_larger_than_a_node_takes_whole_nodes_or_is_refused_by_name():
    assert nodes_per_engine(8, 32, 4) == 4 and nodes_per_engine(8, 16, 8) == 2
    assert nodes_per_engine(8, 4, 1) == 1 and nodes_per_engine(8, 8) == 1
    with pytest.raises(ConfigError, match=r"tp_size=12 spans several engine nodes but is not a multiple of"):
        nodes_per_engine(8, 12, 2)
    with pytest.raises(ConfigError, match=r"rollout.engine_nodes=6 is not a multiple of the 4 nodes .*=32"):
        nodes_per_engine(8, 32, 6)
    with pytest.raises(ConfigError, match="does not divide the 8 GPUs"):  # within a node, as before
        nodes_per_engine(8, 3, 1)


def test_only_each_engines_first_node_is_a_url():
    hosts = [f"n{i}" for i in range(8)]
    assert server_urls(hosts, 1, span=4) == ["http://n0:30000", "http://n4:30000"]
    assert server_urls(hosts[:2], 2) == [f"http://{h}:{30000 + i}" for h in ("n0", "n1") for i in range(2)]


def test_each_node_of_an_engine_gets_its_rank_and_the_engines_first_host():
    rollout = recipe_rollout_config(RECIPE, ["rollout.engine_nodes=8"])  # two engines of 4 nodes
    hosts = [f"e{i}" for i in range(8)]
    for index, host in enumerate(hosts):
        (argv,) = server_commands(rollout, 8, hosts, index)
        first = hosts[index - index % 4]
        assert (_flag(argv, "--nnodes"), _flag(argv, "--node-rank")) == ("4", str(index % 4)), host
        assert _flag(argv, "--dist-init-addr") == f"{first}:{DIST_INIT_PORT}", host
        assert (_flag(argv, "--tp-size"), _flag(argv, "--base-gpu-id"), _flag(argv, "--port")) == (
            "32",
            "0",
            "30000",
        )
    assert node_part(hosts, 5, 4).node_rank == 1
    with pytest.raises(ConfigError, match=r"SRPO_ENGINE_HOSTS lists 4 hosts but rollout\.engine_nodes=8"):
        server_commands(rollout, 8, hosts[:4], 0)
    with pytest.raises(ConfigError, match="need the job's engine host names"):
        server_commands(rollout, 8, None, 0)
    with pytest.raises(ConfigError, match="index 8 is outside the 8 engine hosts"):
        server_commands(rollout, 8, hosts, 8)


def test_launch_refuses_engine_nodes_off_the_engine_span(tmp_path, capsys):
    argv = ["launch", RECIPE, "--cluster", "cluster/h100.yaml", "--nodes", "32", "--dryrun"]
    assert cli.main([*argv, "--home", str(tmp_path), "--override", "rollout.engine_nodes=6"]) == 2
    assert "rollout.engine_nodes=6 is not a multiple of the 4 nodes" in capsys.readouterr().err


def _fake(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_deepseek_v3_dryrun_script_starts_one_4_node_engine(capsys, tmp_path, monkeypatch):
    argv = ["launch", RECIPE, "--cluster", "cluster/h100.yaml", "--nodes", "32", "--dryrun"]
    assert cli.main([*argv, "--home", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "# rollout: 1 engines of TP32 (32 GPUs each) on 4 engine node(s) (32 GPUs)" in out
    script = out[out.index("#!/bin/bash") :]
    assert "#SBATCH --nodes=36" in script  # 32 training + 4 engine nodes
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    line = 'echo "URLS=$SRPO_ENGINE_URLS HOSTS=$SRPO_ENGINE_HOSTS ARGS=$*" >> "$CALLS"\necho 10.0.0.1\n'
    _fake(bin_dir, "srun", line)
    _fake(bin_dir, "scontrol", '[ "$1 $2" = "show hostnames" ] && printf "gpu%s\\n" $(seq 1 36)\n')
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(log)}
    env.update(SLURM_JOB_NODELIST="gpu[1-36]", SLURM_JOB_ID="42")
    run = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    for _ in range(100):  # the engine step runs in the background; the stand-in returns at once
        calls = log.read_text().splitlines()
        if len(calls) >= 4:
            break
        subprocess.run(["sleep", "0.1"])
    (engines,) = [c for c in calls if "srpo_megatron.rollout.sglang.servers" in c]
    (train,) = [c for c in calls if " torchrun " in c]
    hosts = "gpu33,gpu34,gpu35,gpu36"
    assert f"URLS=http://gpu33:30000 HOSTS={hosts} " in engines, "one URL per engine: its first node"
    assert f"URLS=http://gpu33:30000 HOSTS={hosts} " in train
    assert "--nodes=4 --relative=32 --ntasks-per-node=1" in engines
    assert "--nodes=32 --relative=0" in train and "--nnodes 32 --nproc-per-node 8" in train
    # The engine step, node by node: srun gives task k (one per node) SLURM_PROCID=k.
    monkeypatch.setenv("SRPO_ENGINE_HOSTS", hosts)
    for k in range(4):
        monkeypatch.setenv("SLURM_PROCID", str(k))
        assert servers.main([RECIPE, "--gpus", "8", "--print"]) == 0
        cmd = capsys.readouterr().out.split()
        assert _flag(cmd, "--node-rank") == str(k) and _flag(cmd, "--nnodes") == "4"
        assert _flag(cmd, "--dist-init-addr") == f"gpu33:{DIST_INIT_PORT}"
