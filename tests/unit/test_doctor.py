"""`srpo doctor`: a CPU machine passes with the GPU extras absent; each planted fault is named.

The faults are real where this machine allows it (a read-only bind mount, a missing model folder, a
converted checkpoint of another architecture, an all-reduce rank that never joins) and faked only
where it cannot (a CUDA driver, InfiniBand devices, an installed package's version).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from srpo_megatron.cli import main
from srpo_megatron.doctor import environment, paths
from srpo_megatron.doctor.allreduce import run_allreduce
from srpo_megatron.doctor.expectations import NodeExpectations
from srpo_megatron.doctor.ranges import read_pyproject
from srpo_megatron.doctor.report import NOT_INSTALLED_GPU_EXTRA

REPO = Path(__file__).resolve().parents[2]
GPU_EXTRAS = ("transformer-engine", "apex", "sglang")


def _hf_folder(path: Path, num_layers: int = 2) -> Path:
    from transformers import Qwen3Config

    path.mkdir(parents=True)
    cfg = Qwen3Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    )  # fmt: skip
    (path / "config.json").write_text(json.dumps(cfg.to_dict()))
    (path / "model.safetensors").write_bytes(b"")  # the doctor checks presence, never reads weights
    return path


def _recipe(tmp_path: Path, **sections) -> Path:
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1?", "answer": "2"}\n')
    recipe = {
        "model": {"hf_dir": str(tmp_path / "hf")},
        "data": {"train_files": [str(data)]},
        "run": {"dir": str(tmp_path / "run")},
    }
    for key, value in sections.items():
        recipe[key].update(value)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def _doctor_json(capsys, *args: str) -> tuple[int, dict[str, dict]]:
    rc = main(["doctor", *args, "--json"])
    report = json.loads(capsys.readouterr().out)
    return rc, {c["name"]: c for c in report["checks"]}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-machine report")
def test_cpu_machine_passes_with_gpu_extras_absent(capsys, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    rc, checks = _doctor_json(capsys)
    assert rc == 0
    assert all(c["status"] != "fail" for c in checks.values()), checks
    for name in GPU_EXTRAS:
        if environment._installed(name) is None and name != "apex":
            assert checks[name] == {
                "name": name, "status": "ok", "detail": NOT_INSTALLED_GPU_EXTRA, "fix": ""
            }  # fmt: skip
    assert checks["apex"]["detail"] == NOT_INSTALLED_GPU_EXTRA
    assert checks["megatron-core"]["status"] == "ok"
    assert checks["nccl all-reduce"]["detail"].startswith("skipped")


def test_cli_json_exit_status_in_a_fresh_process(tmp_path):
    """The installed entry point end to end: exit 0 and a JSON report (the job step runs exactly this)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("SLURM_JOB_ID", None)
    out = subprocess.run(
        [sys.executable, "-m", "srpo_megatron.cli", "doctor", "--json"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert json.loads(out.stdout)["passed"] is True


def test_missing_model_path_fails_naming_it(tmp_path, capsys):
    recipe = _recipe(tmp_path)  # model.hf_dir = <tmp>/hf, never created
    rc, checks = _doctor_json(capsys, str(recipe))
    assert rc == 1
    assert checks["model.hf_dir"]["status"] == "fail"
    assert str(tmp_path / "hf") in checks["model.hf_dir"]["detail"]
    assert checks["run.dir"]["status"] == "ok" and checks["data files"]["status"] == "ok"
    # The text form names it on a FAIL line, as a job log shows it.
    assert main(["doctor", str(recipe)]) == 1
    line = next(x for x in capsys.readouterr().out.splitlines() if "model.hf_dir" in x)
    assert line.split()[0] == "FAIL" and str(tmp_path / "hf") in line


def test_complete_recipe_passes_and_overrides_apply(tmp_path, capsys):
    _hf_folder(tmp_path / "hf")
    recipe = _recipe(tmp_path)
    rc, checks = _doctor_json(capsys, str(recipe))
    assert rc == 0, checks
    rc, checks = _doctor_json(capsys, str(recipe), "--override", f"data.train_files=[{tmp_path}/nope.jsonl]")
    assert rc == 1 and f"{tmp_path}/nope.jsonl" in checks["data files"]["detail"]


def test_converted_checkpoint_of_another_architecture_is_caught(tmp_path, capsys):
    hf = _hf_folder(tmp_path / "hf", num_layers=2)
    ckpt = tmp_path / "mcore"
    ckpt.mkdir()
    (ckpt / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    shutil.copy(_hf_folder(tmp_path / "other", num_layers=3) / "config.json", ckpt / "hf_config.json")
    recipe = _recipe(tmp_path, model={"megatron_checkpoint": str(ckpt)})
    rc, checks = _doctor_json(capsys, str(recipe))
    assert rc == 1
    assert checks["model.megatron_checkpoint"]["status"] == "ok"
    mismatch = checks["checkpoint vs HF config"]
    assert mismatch["status"] == "fail" and "num_layers: checkpoint 3 != HF 2" in mismatch["detail"]
    shutil.copy(hf / "config.json", ckpt / "hf_config.json")  # the right conversion passes
    rc, checks = _doctor_json(capsys, str(recipe))
    assert rc == 0 and checks["checkpoint vs HF config"]["status"] == "ok"


def test_read_only_run_dir_is_named(tmp_path):
    """A real read-only bind mount (a private mount namespace); skipped where mounts are not allowed."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare for a read-only bind mount")
    src, ro = tmp_path / "src", tmp_path / "ro"
    src.mkdir(), ro.mkdir()
    _hf_folder(tmp_path / "hf")
    recipe = _recipe(tmp_path, run={"dir": str(ro / "runs" / "x")})
    script = (
        f"mount --bind {src} {ro} && mount -o remount,bind,ro {ro} || exit 77; "
        f"exec {sys.executable} -m srpo_megatron.cli doctor {recipe}"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", script],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    if out.returncode == 77 or "unshare failed" in out.stderr:
        pytest.skip(f"mount namespaces not permitted here: {out.stderr.strip()}")
    assert out.returncode == 1, out.stdout + out.stderr
    line = next(x for x in out.stdout.splitlines() if " run.dir " in x)
    assert line.split()[0] == "FAIL"
    assert str(ro / "runs" / "x") in line and "Read-only file system" in line


def test_node_local_run_dir_fails_only_for_multi_node(tmp_path):
    assert paths.check_run_dir(str(tmp_path / "r"), shared_required=False).status == "ok"
    check = paths.check_run_dir(str(tmp_path / "r"), shared_required=True)
    assert check.status == "fail" and "node-local" in check.detail
    mounts = "rootfs / ext4 rw 0 0\nfs1@o2ib:/scratch /lustre lustre rw 0 0\nhost:/h /home nfs4 rw 0 0\n"
    assert paths.filesystem_type(Path("/lustre/fsw/me/runs/x"), mounts) == "lustre"
    assert paths.filesystem_type(Path("/home/me"), mounts) == "nfs4"
    assert paths.filesystem_type(Path("/lustrefoo"), mounts) == "ext4"  # a prefix, not a mount point
    assert paths.is_shared("lustre") and paths.is_shared("fuse.juicefs") and not paths.is_shared("ext4")


def test_allreduce_sums_across_processes_and_reports_a_rank_that_never_joins():
    good = run_allreduce(2, backend="gloo", timeout=120)
    assert good.status == "ok" and good.detail.startswith("2 ranks"), good
    # Rank 1 never starts, so rank 0 waits in the rendezvous: both are reported, after the timeout.
    hung = run_allreduce(2, backend="gloo", timeout=10, start_ranks=1)
    assert hung.status == "fail" and "rank(s) [0, 1] did not finish within 10 s" in hung.detail, hung


def _sysfs_ib(root: Path, state: str, layer: str = "InfiniBand") -> Path:
    port = root / "mlx5_0" / "ports" / "1"
    port.mkdir(parents=True)
    (port / "state").write_text(state + "\n")
    (port / "link_layer").write_text(layer + "\n")
    return root


def test_infiniband(tmp_path):
    none = tmp_path / "none"
    assert environment.check_infiniband(False, False, none).status == "ok"
    assert environment.check_infiniband(True, True, none).status == "fail"
    active = environment.check_infiniband(True, True, _sysfs_ib(tmp_path / "a", "4: ACTIVE"))
    assert active.status == "ok" and "mlx5_0/1 ACTIVE (InfiniBand)" in active.detail
    down = environment.check_infiniband(True, True, _sysfs_ib(tmp_path / "d", "1: DOWN"))
    assert down.status == "fail" and "no ACTIVE port" in down.detail


def test_cuda_driver_against_runtime(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.9")
    monkeypatch.setattr(environment, "_driver_release", lambda: "535.1")
    monkeypatch.setattr(environment, "_driver_cuda_version", lambda: 11080)
    assert environment.check_cuda(gpu_node=True).status == "fail"
    monkeypatch.setattr(environment, "_driver_cuda_version", lambda: 12020)
    assert environment.check_cuda(gpu_node=True).status == "warn"  # minor-version compatibility
    monkeypatch.setattr(environment, "_driver_cuda_version", lambda: 12090)
    assert environment.check_cuda(gpu_node=True).status == "ok"
    monkeypatch.setattr(environment, "_driver_cuda_version", lambda: None)
    assert environment.check_cuda(gpu_node=True).status == "fail"
    assert environment.check_cuda(gpu_node=False).status == "ok"


def test_versions_against_the_tested_ranges(monkeypatch):
    ranges = read_pyproject()
    mcore = str(ranges.get("megatron-core"))
    assert ">=0.16.1" in mcore
    for version, status in [("0.16.1", "ok"), ("0.19.2", "ok"), ("0.15.3", "fail"), ("0.20.1", "warn")]:
        monkeypatch.setattr(environment, "_installed", lambda *d, v=version: (d[0], v))
        check = environment._version_check("megatron-core", ("megatron-core",), ranges, True, False)
        assert check.status == status, check
    monkeypatch.setattr(environment, "_installed", lambda *d: None)
    gpu = environment._version_check("sglang", ("sglang",), ranges, gpu_node=True, gpu_extra=True)
    cpu = environment._version_check("sglang", ("sglang",), ranges, gpu_node=False, gpu_extra=True)
    assert gpu.status == "fail" and (cpu.status, cpu.detail) == ("ok", NOT_INSTALLED_GPU_EXTRA)


def test_the_pypi_apex_impostor_is_refused(tmp_path, monkeypatch):
    (tmp_path / "apex").mkdir()
    (tmp_path / "apex" / "__init__.py").write_text("# the 2013 web toolkit\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    check = environment.check_apex(gpu_node=False)
    assert check.status == "fail" and "unrelated PyPI package" in check.detail
    (tmp_path / "apex" / "optimizers").mkdir()  # NVIDIA apex's layout, but no CUDA extensions built
    check = environment.check_apex(gpu_node=True)
    assert check.status == "fail" and "amp_C" in check.detail


def test_expectations_inside_a_slurm_job():
    e = NodeExpectations.from_environment(
        {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "4", "SLURM_GPUS_ON_NODE": "8"}
    )
    assert (e.gpus, e.multi_node, e.shared_fs) == (8, True, True) and "Slurm job 7" in e.where
    e = NodeExpectations.from_environment({"SLURM_JOB_ID": "8", "SLURM_JOB_NUM_NODES": "1"})
    assert (e.gpus, e.multi_node, e.shared_fs) == (0, False, False)
    assert NodeExpectations.from_environment({}).gpus is None


def test_hf_home(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HOME", raising=False)
    assert paths.check_hf_home({}, on_cluster=False).status == "ok"
    assert paths.check_hf_home({}, on_cluster=True).status == "warn"  # per-node caches on a cluster
    check = paths.check_hf_home({"HF_HOME": str(tmp_path / "nope")}, on_cluster=True)  # from the cluster file
    assert check.status == "warn" and str(tmp_path / "nope") in check.detail
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # the job's environment wins
    assert paths.check_hf_home({"HF_HOME": "/elsewhere"}, on_cluster=True) == paths.ok(
        "HF_HOME", str(tmp_path)
    )
