"""`srpo launch` runs `srpo doctor` on every node as the job's first step, on the real local Slurm.

A recipe whose model folder does not exist must fail the job in that first step: training never
starts (no torchrun step in Slurm's accounting), the job ends FAILED, and its log holds the doctor's
FAIL line naming the path. Skips without SLURM_CONF, like tests/integration/test_launch_slurm.py,
whose cluster check and nemo-run home fixtures (tests/helpers/slurm.py) it shares.
"""

from __future__ import annotations

import subprocess

import pytest
import yaml

from srpo_megatron.launch import commands, jobs
from tests.helpers.slurm import home, slurm_cluster  # noqa: F401 (fixtures)

pytestmark = pytest.mark.slurm


def _recipe(tmp_path, missing_model):
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "1+1?", "answer": "2"}\n')
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        yaml.safe_dump(
            {
                "model": {"hf_dir": str(missing_model)},
                "data": {"train_files": [str(data)]},
                "run": {"dir": str(tmp_path / "run")},
                "train": {"steps": 1},
            }
        )
    )
    return recipe


def test_job_with_missing_model_fails_in_its_doctor_step(tmp_path, capsys):
    missing = tmp_path / "models" / "not-there"
    recipe = _recipe(tmp_path, missing)
    rc = commands.main(["launch", str(recipe), "--cluster", "cluster/ci.yaml", "--wait", "--timeout", "300"])
    out = capsys.readouterr()
    assert rc == 1, out.out + out.err
    assert "ended FAILED" in out.err
    exp = jobs.load_experiment()
    [info] = jobs.job_infos(exp)
    assert info.state == "FAILED"
    log = jobs.read_logs(exp, info)
    fail_line = next(line for line in log.splitlines() if "model.hf_dir" in line)
    assert fail_line.split()[0] == "FAIL" and f"{missing} does not exist" in fail_line, log
    assert "srpo doctor: FAILED on" in log and f"(Slurm job {info.job_id}, 1 node(s))" in log
    # The training step never ran: Slurm accounted the doctor's step, and no torchrun step.
    steps = subprocess.run(
        ["sacct", "-n", "-P", "-j", info.job_id, "--format=JobName"], capture_output=True, text=True
    ).stdout.split()
    assert "python" in steps and "torchrun" not in steps, steps
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
