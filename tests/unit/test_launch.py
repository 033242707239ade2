"""`srpo launch` without a cluster: cluster files, request checks, errors, and the sbatch script of a dry run.

The dry run builds the real nemo-run Experiment and reads back the sbatch script nemo-run would submit;
the assertions are the numbers the recipe/cluster ask for, written out by hand.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from pathlib import Path

import pytest
import yaml

from srpo_megatron.config import (
    ClusterConfig,
    ConfigError,
    RolloutConfig,
    SGLangEngineConfig,
    TunnelConfig,
    load_cluster,
    load_recipe,
)
from srpo_megatron.launch import commands, probe
from srpo_megatron.launch.experiment import LaunchRequest, RolloutPlacement, srpo_train_command, submit

REPO = Path(__file__).resolve().parents[2]
QWEN_RECIPE = REPO / "examples" / "qwen3_8b_srpo.yaml"
TINY_RECIPE = REPO / "examples" / "tiny_cpu_test.yaml"


@pytest.fixture(autouse=True)
def _stdin_devnull(monkeypatch):
    # nemo-run runs shell steps through `invoke`, which mirrors stdin into them; pytest's captured stdin
    # raises on read, so give them an empty one (as a detached CLI run would have).
    with open(os.devnull) as f:
        monkeypatch.setattr(sys, "stdin", f)
        yield


def _write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


def _recipe(path: Path, sections: dict) -> Path:
    """A whole recipe (`srpo launch` loads it as `srpo train` does): the tiny one, ``sections`` over it,
    with a data file that exists (launch refuses a missing one, as train does)."""
    data = path.with_suffix(".jsonl")
    data.write_text('{"prompt": "p", "system": null, "answer": "1", "kind": "coin"}\n')
    return _write(path, {"base": str(TINY_RECIPE), "data": {"train_files": [str(data)]}, **sections})


# ---- cluster files ------------------------------------------------------------------------------------


def test_shipped_cluster_files_load():
    h100 = load_cluster(REPO / "cluster" / "h100.yaml")
    assert (h100.executor, h100.gpus_per_node, h100.procs_per_node) == ("slurm", 8, 8)
    assert h100.account and h100.container_image and h100.tunnel.kind == "ssh"
    assert load_cluster("ci").executor == "slurm" and load_cluster("ci").max_nodes == 1
    assert load_cluster("local").executor == "local"


def test_unknown_cluster_file_lists_valid_ones():
    with pytest.raises(
        ConfigError, match=r"does not exist; valid ones: .*cluster/ci\.yaml.*cluster/h100\.yaml"
    ):
        load_cluster("cluster/nope.yaml")


def test_unknown_cluster_field_lists_valid_fields(tmp_path):
    bad = _write(tmp_path / "c.yaml", {"name": "x", "gpus_per_nodes": 8})
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['gpus_per_nodes'\].*'gpus_per_node'"):
        load_cluster(bad)


@pytest.mark.parametrize(
    ("fields", "missing"),
    [
        ({"container_image": "img.sqsh"}, "no account"),
        ({"account": "acct"}, "no container_image"),
        ({}, "no account and no container_image"),
    ],
)
def test_gpu_cluster_needs_account_and_image(fields, missing):
    with pytest.raises(ConfigError, match=missing):
        ClusterConfig(name="g", gpus_per_node=8, **fields)


def test_ssh_tunnel_needs_host_user_dir():
    with pytest.raises(ConfigError, match=r"needs \['user', 'job_dir'\]"):
        TunnelConfig(kind="ssh", host="login")


def test_ssh_tunnel_needs_shipped_code():
    with pytest.raises(ConfigError, match="set code: git"):
        ClusterConfig(name="r", tunnel=TunnelConfig(kind="ssh", host="h", user="u", job_dir="/d"))


def test_request_larger_than_partition_is_refused():
    c = ClusterConfig(name="g", gpus_per_node=8, account="a", container_image="i", max_nodes=4)
    c.check_request(4, 8)  # exactly the partition: fine
    with pytest.raises(ConfigError, match=r"needs 5 nodes .* at most 4"):
        c.check_request(5)
    with pytest.raises(ConfigError, match=r"needs 16 GPUs per node .* have 8"):
        c.check_request(1, 16)


SGLANG = {"engine": "sglang", "sglang": {"model_path": "/m", "weight_sync": "distributed"}}


def test_rollout_placement_from_the_loaded_recipe(tmp_path):
    assert RolloutPlacement.from_config(RolloutConfig()) == RolloutPlacement("colocated", 0)
    recipe = _recipe(tmp_path / "r.yaml", {"rollout": {**SGLANG, "placement": "separate", "engine_nodes": 2}})
    sep = RolloutPlacement.from_config(load_recipe(recipe).rollout)
    request = LaunchRequest("x", srpo_train_command("r.yaml"), nodes=4, placement=sep)
    assert request.job_nodes("slurm") == 6  # Slurm starts the servers on 2 nodes of its own
    assert request.job_nodes("local") == 4  # the local executor starts none: they already run
    with pytest.raises(ConfigError, match="engine_nodes >= 1"):
        load_recipe(recipe, ["rollout.engine_nodes=0"])
    with pytest.raises(ConfigError, match=r"rollout.placement: 'remote' is not valid"):
        load_recipe(recipe, ["rollout.placement=remote"])


def test_git_shipped_recipe_must_be_committed(tmp_path, capsys):
    # h100 ships `git archive HEAD`: a recipe the archive lacks would only fail on the cluster.
    # runs/ is git-ignored: a file there lies inside the repository but never in HEAD.
    recipe = REPO / "runs" / f"_uncommitted_{os.getpid()}.yaml"
    recipe.parent.mkdir(exist_ok=True)
    recipe.write_text(f"base: {TINY_RECIPE}\ntrain: {{steps: 1}}\n")
    try:
        args = ["launch", str(recipe.relative_to(REPO)), "--cluster", "h100", "--dryrun"]
        assert commands.main([*args, "--home", str(tmp_path)]) == 2
    finally:
        recipe.unlink()
    assert "is not committed" in capsys.readouterr().err


def test_cli_reports_oversized_request(tmp_path, capsys):
    recipe = _recipe(tmp_path / "r.yaml", {"run": {"dir": str(tmp_path / "run")}})
    rc = commands.main(
        [
            "launch",
            str(recipe),
            "--cluster",
            "cluster/h100.yaml",
            "--nodes",
            "65",
            "--dryrun",
            "--home",
            str(tmp_path),
        ]
    )
    assert rc == 2
    assert "needs 65 nodes" in capsys.readouterr().err


SEPARATE = {"rollout": {**SGLANG, "placement": "separate", "engine_nodes": 1}}


def test_local_separate_placement_needs_running_servers_and_counts_no_engine_nodes(
    tmp_path, capsys, monkeypatch
):
    """cluster/local.yaml (max_nodes 1) starts no engine nodes: a separate placement runs against servers
    listed in SRPO_ENGINE_URLS, and without them it is refused with the variable and the fix named."""
    recipe = _recipe(tmp_path / "r.yaml", SEPARATE)
    args = ["launch", str(recipe), "--cluster", "cluster/local.yaml", "--dryrun", "--home", str(tmp_path)]
    monkeypatch.delenv("SRPO_ENGINE_URLS", raising=False)
    assert commands.main(args) == 2
    err = capsys.readouterr().err
    assert "needs 2 nodes" not in err, "the engine node was counted on the local executor"
    assert "SRPO_ENGINE_URLS is unset" in err and "export SRPO_ENGINE_URLS=http://HOST:PORT" in err, err

    monkeypatch.setenv("SRPO_ENGINE_URLS", "http://10.0.0.7:30000, http://10.0.0.7:30001")
    assert commands.main(args) == 0, capsys.readouterr().err
    assert "2 running server(s)" in capsys.readouterr().out


def test_local_separate_placement_hands_the_servers_to_the_job(monkeypatch):
    from srpo_megatron.launch.experiment import build_experiment

    monkeypatch.delenv("SRPO_ENGINE_URLS", raising=False)
    local, command = load_cluster("local"), srpo_train_command("r.yaml")
    separate = RolloutConfig(
        **{
            **SEPARATE["rollout"],
            "sglang": SGLangEngineConfig(model_path="/m", weight_sync="disk", disk_sync_dir="/d"),
        }
    )
    given = LaunchRequest("x", command, placement=RolloutPlacement.from_config(separate))
    with pytest.raises(ConfigError, match="SRPO_ENGINE_URLS is unset"):
        build_experiment(local, given)
    given.env["SRPO_ENGINE_URLS"] = "http://h:1,http://h:2"
    env = build_experiment(local, given)[0].executor.env_vars
    assert (env["SRPO_ENGINE_URLS"], env["SRPO_ROLLOUT_ENGINES"], env["SRPO_ENGINE_NODES"]) == (
        "http://h:1,http://h:2",
        "2",
        "1",
    )
    # Servers named by the recipe (rollout.sglang.url) serve as well, as `srpo train` reads them.
    in_recipe = dataclasses.replace(separate, sglang=dataclasses.replace(separate.sglang, url="http://s:9"))
    request = LaunchRequest("x", command, placement=RolloutPlacement.from_config(in_recipe))
    assert build_experiment(local, request)[0].executor.env_vars["SRPO_ENGINE_URLS"] == "http://s:9"


def test_the_local_executor_refuses_more_than_one_node():
    from srpo_megatron.launch.experiment import build_experiment

    two = dataclasses.replace(load_cluster("local"), max_nodes=2)  # a hand-written file allowing more
    with pytest.raises(ConfigError, match="runs on this one machine; use --nodes 1"):
        build_experiment(two, LaunchRequest("x", srpo_train_command("r.yaml"), nodes=2))


# ---- dry run: the sbatch script -----------------------------------------------------------------------


def _sbatch_flags(script: str) -> dict[str, str]:
    flags = {}
    for m in re.finditer(r"^#SBATCH --([\w-]+)(?:=(\S+))?$", script, re.M):
        flags[m.group(1)] = m.group(2) or ""
    return flags


def _qwen_dryrun(tmp_path: Path, capsys) -> tuple[str, str, int]:
    """The sbatch script for the 8B recipe on 4 H100 nodes, the recipe path the job is given, and the
    engine nodes the recipe asks for on top (rollout.placement 'separate')."""
    if QWEN_RECIPE.is_file():
        args = [str(QWEN_RECIPE.relative_to(REPO)), "--cluster", "cluster/h100.yaml", "--nodes", "4"]
        assert commands.main(["launch", *args, "--dryrun", "--home", str(tmp_path)]) == 0
        rollout = yaml.safe_load(QWEN_RECIPE.read_text()).get("rollout") or {}
        engine_nodes = rollout.get("engine_nodes", 0) if rollout.get("placement") == "separate" else 0
        return capsys.readouterr().out, "examples/qwen3_8b_srpo.yaml", engine_nodes
    # Until the lead's recipe lands: the same keys in a tmp recipe. h100 ships the code with git, which
    # needs a committed recipe; the tmp one is given in place from the login node instead (the rest of the
    # script is the same).
    recipe = _recipe(
        tmp_path / "qwen3_8b_srpo.yaml", {"run": {"dir": "/lustre/runs/q"}, "train": {"steps": 10}}
    )
    cluster = dataclasses.replace(load_cluster("h100"), code="in_place", tunnel=TunnelConfig())
    request = LaunchRequest("srpo-qwen3_8b_srpo", srpo_train_command(str(recipe)), nodes=4)
    from srpo_megatron.launch.jobs import set_home

    set_home(tmp_path)
    return submit(cluster, request, dryrun=True).script, str(recipe), 0


def test_dryrun_h100_four_nodes(tmp_path, capsys):
    script, recipe_arg, engine_nodes = _qwen_dryrun(tmp_path, capsys)
    flags = _sbatch_flags(script)
    # 4 training nodes (+ the recipe's SGLang nodes), 8 GPUs each, one torchrun agent per node with 8
    # workers.
    nodes = 4 + engine_nodes
    assert flags["nodes"] == str(nodes)
    assert flags["gpus-per-node"] == "8"
    assert flags["ntasks-per-node"] == "1"
    assert (flags["account"], flags["partition"], flags["time"]) == ("my_account", "batch", "04:00:00")
    assert "exclusive" in flags and flags["mem"] == "0"
    srun = next(line for line in script.splitlines() if line.startswith("srun --output"))
    # pyxis/enroot container flags.
    assert "--container-image /lustre/fsw/my_account/images/srpo_megatron.sqsh" in srun
    mounts = re.search(r"--container-mounts (\S+)", srun).group(1).split(",")
    assert "/lustre/fsw/my_account:/lustre/fsw/my_account" in mounts
    assert any(m.endswith(":/nemo_run") for m in mounts)
    # Multi-node torchrun: c10d rendezvous on the first node's IP, node rank from Slurm.
    torchrun = srun[srun.index("torchrun") :].split()
    opt = {torchrun[i]: torchrun[i + 1] for i in range(1, len(torchrun) - 1) if torchrun[i].startswith("--")}
    assert opt["--nnodes"] == str(nodes) and opt["--nproc-per-node"] == "8"
    assert opt["--rdzv-backend"] == "c10d" and opt["--rdzv-endpoint"] == "$head_node_ip:29500"
    assert opt["--node-rank"] == "$SLURM_NODEID"
    assert 'head_node_ip=$(srun --nodes=1 --ntasks=1 -w "$head_node" hostname --ip-address)' in script
    assert srun.endswith(f"-m srpo_megatron.cli train {recipe_arg}")
    # Job environment: megatron's single CUDA queue and the cluster's NCCL settings.
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1" in script
    assert "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in script
    assert "export SRPO_TRAIN_NODES=4" in script and f"export SRPO_ENGINE_NODES={engine_nodes}" in script
    # Requeue: Slurm requeues on preemption (sbatch --requeue), and once after a crash (max_retries: 1).
    assert "sbatch --requeue" in script and "export TORCHX_MAX_RETRIES=1" in script


def test_dryrun_separate_rollout_nodes_and_overrides(tmp_path):
    recipe = _recipe(tmp_path / "r.yaml", {"rollout": {**SGLANG, "placement": "separate", "engine_nodes": 2}})
    cluster = dataclasses.replace(load_cluster("h100"), code="in_place", tunnel=TunnelConfig())
    from srpo_megatron.launch.jobs import set_home

    set_home(tmp_path)
    request = LaunchRequest(
        "srpo-r",
        srpo_train_command(str(recipe), ["train.steps=5", "run.dir=/x"]),
        nodes=2,
        placement=RolloutPlacement.from_config(load_recipe(recipe).rollout),
    )
    script = submit(cluster, request, dryrun=True).script
    assert _sbatch_flags(script)["nodes"] == "4"  # 2 training + 2 engine nodes
    assert "--nnodes 4 --nproc-per-node 8" in script
    assert "export SRPO_ROLLOUT_PLACEMENT=separate" in script and "export SRPO_ENGINE_NODES=2" in script
    assert script.rstrip().splitlines()[-1] != ""  # script complete
    assert f"train {recipe} --override train.steps=5 --override run.dir=/x" in script
    # In-place code inside a container: the checkout is mounted and put on PYTHONPATH.
    assert f"{REPO}:{REPO}" in script and f"export PYTHONPATH={REPO}:" in script


# ---- the probe job (the trainer's run-directory contract) ---------------------------------------------


def test_probe_resumes_after_latest(tmp_path):
    probe.main(["--run-dir", str(tmp_path), "--steps", "2"])
    with pytest.raises(RuntimeError, match="deliberate failure at step 4"):
        probe.main(["--run-dir", str(tmp_path), "--steps", "5", "--fail-at-step", "4"])
    assert probe.latest_step(tmp_path) == 3
    probe.main(["--run-dir", str(tmp_path), "--steps", "5"])
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5]


def test_launch_counts_rollout_engines_from_the_recipe():
    """8 engines of TP4 on 4 nodes × 8 GPUs colocated; a separate placement counts its engine nodes."""
    colocated = RolloutPlacement.from_config(load_recipe(QWEN_RECIPE).rollout)
    assert colocated.engines(4, 8) == 8
    assert (
        colocated.describe(4, 8)
        == "rollout: 8 engines of TP4 (4 GPUs each) colocated on the 32 training GPUs"
    )
    sglang = SGLangEngineConfig(model_path="/m", weight_sync="distributed", engine_kwargs={"tp_size": 2})
    sep = RolloutPlacement.from_config(
        RolloutConfig(engine="sglang", placement="separate", engine_nodes=2, sglang=sglang)
    )
    assert sep.engines(4, 8) == 8 and "on 2 engine node(s) (16 GPUs)" in sep.describe(4, 8)
    with pytest.raises(ConfigError, match="gpus_per_engine=3"):
        RolloutPlacement.from_config(RolloutConfig(gpus_per_engine=3)).engines(1, 8)
