"""The sbatch lines that make `srpo doctor` the job's first step, run by bash against a stand-in `srun`.

The real sbatch path is covered by tests/integration/test_launch_slurm.py; here the stand-in `srun`
records its arguments, so the flag reuse, the ordering and the early exit are checked exactly.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from srpo_megatron.doctor.first_step import slurm_setup_lines

# What nemo-run writes: its srun flags (container, log, workdir) and then the torchrun command.
NEMO_SRUN = (
    "srun --output /j/log-x_%j_0.out --container-image /img.sqsh --container-mounts /a:/a,/j:/nemo_run "
    "--container-workdir /nemo_run/code --wait=60 --kill-on-bad-exit=1 "
    "torchrun --nnodes 2 -m srpo_megatron.cli train examples/r.yaml --override 'run.dir=/x y'"
)


def _run(tmp_path: Path, doctor_rc: int) -> tuple[int, list[str], str]:
    calls = tmp_path / "calls"
    fake = tmp_path / "bin" / "srun"
    fake.parent.mkdir(exist_ok=True)
    # The stand-in srun: one line per call; the doctor step exits with doctor_rc.
    fake.write_text(
        f'#!/bin/bash\necho "$*" >> {calls}\n'
        f'for a in "$@"; do [ "$a" = doctor ] && exit {doctor_rc}; done\nexit 0\n'
    )
    fake.chmod(0o755)
    script = (
        f"PATH={fake.parent}:$PATH\nSLURM_JOB_ID=42\n"
        + slurm_setup_lines("examples/r.yaml", ["run.dir=/x y"])
        + f"\n{NEMO_SRUN}\necho training-step-returned\n"
    )
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    lines = calls.read_text().splitlines() if calls.exists() else []
    return out.returncode, lines, out.stdout


@pytest.mark.parametrize("doctor_rc", [0, 1])
def test_doctor_runs_first_with_the_training_steps_flags(tmp_path, doctor_rc):
    rc, calls, stdout = _run(tmp_path, doctor_rc)
    flags = NEMO_SRUN[len("srun ") : NEMO_SRUN.index(" torchrun")]
    doctor = (
        f"{flags} --ntasks-per-node=1 python -m srpo_megatron.cli doctor examples/r.yaml "
        "--override run.dir=/x y"
    )
    assert calls[0] == doctor  # same container, mounts, workdir and log file as the training step
    if doctor_rc == 0:
        assert rc == 0 and len(calls) == 2 and calls[1].endswith("--override run.dir=/x y")
        assert "torchrun --nnodes 2" in calls[1] and "training-step-returned" in stdout
    else:
        # The job ends before training, with the doctor's status, and says why.
        assert rc == 1 and len(calls) == 1 and "training-step-returned" not in stdout
        assert "srpo doctor failed (exit 1) in job 42: training not started" in stdout


def test_other_srun_calls_pass_through(tmp_path):
    fake = tmp_path / "bin" / "srun"
    fake.parent.mkdir()
    fake.write_text('#!/bin/bash\necho "real srun $*"\n')
    fake.chmod(0o755)
    script = f"PATH={fake.parent}:$PATH\n" + slurm_setup_lines(None, []) + "\nsrun hostname\n"
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == "real srun hostname"


def test_launch_puts_the_doctor_step_in_the_sbatch_script_unless_skipped(tmp_path, capsys, monkeypatch):
    from srpo_megatron.launch import commands

    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {hf_dir: /m}\ndata: {train_files: [/d.jsonl]}\n")
    launch = ["launch", str(recipe), "--cluster", "cluster/ci.yaml", "--dryrun", "--home", str(tmp_path)]
    # nemo-run runs shell steps through `invoke`, which mirrors stdin; pytest's captured stdin raises.
    with open(os.devnull) as devnull:
        monkeypatch.setattr(sys, "stdin", devnull)
        assert commands.main([*launch, "-o", "train.steps=1"]) == 0
        script = capsys.readouterr().out
        assert commands.main([*launch, "--skip-doctor"]) == 0
        skipped = capsys.readouterr().out
    doctor = f"python -m srpo_megatron.cli doctor {recipe.resolve()} --override train.steps=1"
    assert doctor in script and script.index(doctor) < script.index("torchrun --rdzv")
    assert "srpo_megatron.cli doctor" not in skipped and "torchrun --rdzv" in skipped


def test_local_launch_runs_the_doctor_here_and_submits_nothing_when_it_fails(tmp_path, capsys):
    from srpo_megatron.launch import commands

    missing = tmp_path / "no-model"
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {{hf_dir: {missing}}}\ndata: {{arithmetic: {{}}}}\nrun: {{dir: {tmp_path}}}\n")
    home = tmp_path / "home"
    assert commands.main(["launch", str(recipe), "--cluster", "cluster/local.yaml", "--home", str(home)]) == 1
    line = next(x for x in capsys.readouterr().out.splitlines() if "model.hf_dir" in x)
    assert line.split()[0] == "FAIL" and str(missing) in line
    assert not list(home.glob("experiments/*"))  # nothing was submitted
