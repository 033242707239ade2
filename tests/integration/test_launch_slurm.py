"""`srpo launch` / `srpo jobs` against the real single-node Slurm that tools/slurm_local.sh starts.

Every job goes through nemo-run's SlurmExecutor, sbatch, srun and torchrun exactly as on a GPU cluster
(cluster/ci.yaml). With SLURM_CONF unset (a laptop without Slurm) these tests skip; with it set (CI always
sets it) a cluster that does not answer is a failure, not a skip.

The probe job (srpo_megatron.launch.probe) has the trainer's run-directory contract and takes no model,
so launching, failure reporting, cancel + resubmit and preemption requeue are checked in seconds; the
`srpo train` test at the end runs the real trainer on examples/tiny_cpu_test.yaml the same way.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from srpo_megatron.config import load_cluster
from srpo_megatron.launch import commands, jobs
from srpo_megatron.launch.experiment import JobCommand, LaunchRequest, submit
from srpo_megatron.launch.probe import latest_step
from tests.helpers.slurm import home, slurm_cluster  # noqa: F401 (fixtures)

pytestmark = pytest.mark.slurm
REPO = Path(__file__).resolve().parents[2]


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.is_file() else []


def _probe(run_dir: Path, *extra: str) -> LaunchRequest:
    return LaunchRequest(
        "probe", JobCommand("srpo_megatron.launch.probe", ("--run-dir", str(run_dir), *extra))
    )


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        time.sleep(0.3)


def test_launch_completes_and_jobs_logs_shows_output(tmp_path, capsys):
    run_dir = tmp_path / "run"
    recipe = tmp_path / "probe.yaml"
    tiny = Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu_test.yaml"  # a whole recipe
    recipe.write_text(
        yaml.safe_dump({"base": str(tiny), "run": {"dir": str(run_dir)}, "train": {"steps": 3}})
    )
    rc = commands.main(
        ["launch", str(recipe), "--cluster", "cluster/ci.yaml", "--probe", "--wait", "--timeout", "120"]
    )
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "COMPLETED" in out.out
    assert _steps(run_dir) == [1, 2, 3]

    assert commands.main(["jobs", "status"]) == 0
    status = capsys.readouterr().out.split()
    assert "COMPLETED" in status and any(s.startswith("slurm_id=") and s != "slurm_id=-" for s in status)
    assert commands.main(["jobs", "logs"]) == 0
    logs = capsys.readouterr().out
    assert "probe: step 3/3 done" in logs and "probe: finished" in logs
    assert "probe: rank 0/1" in logs  # torchrun set RANK/WORLD_SIZE inside the Slurm job


def test_failing_job_is_reported_failed_with_log_tail(tmp_path):
    cluster = load_cluster("ci")
    result = submit(cluster, _probe(tmp_path / "run", "--steps", "3", "--fail-at-step", "2"))
    exp = jobs.load_experiment(result.experiment_id)
    infos = jobs.wait(exp, timeout=120)
    assert [i.state for i in infos] == ["FAILED"]
    with pytest.raises(jobs.JobError) as err:
        jobs.check_completed(exp, infos)
    msg = str(err.value)
    assert "ended FAILED" in msg
    assert "first worker error: [default0]:RuntimeError: probe: deliberate failure at step 2" in msg
    assert "ChildFailedError" in msg  # the log tail itself (torchrun's report)
    assert _steps(tmp_path / "run") == [1]


def test_cancelled_job_resubmitted_resumes(tmp_path, capsys):
    run_dir = tmp_path / "run"
    cluster = load_cluster("ci")
    first = submit(cluster, _probe(run_dir, "--steps", "15", "--step-seconds", "0.3"))
    _wait_for(lambda: latest_step(run_dir) >= 2, 90, "two steps of the first job")
    assert commands.main(["jobs", "cancel", first.experiment_id]) == 0
    assert "CANCELLED" in capsys.readouterr().out
    cancelled_at = latest_step(run_dir)
    before = _steps(run_dir)
    assert 2 <= cancelled_at < 15, "the job must be cancelled mid-run"

    second = submit(cluster, _probe(run_dir, "--steps", "15"))
    exp = jobs.load_experiment(second.experiment_id)
    jobs.check_completed(exp, jobs.wait(exp, timeout=120))
    steps = _steps(run_dir)
    assert steps[: len(before)] == before
    # The resubmitted job continues after the last checkpoint instead of starting again at step 1.
    assert steps[len(before) :] == list(range(cancelled_at + 1, 16))


def test_preempted_job_is_requeued_and_resumes(tmp_path):
    """Preemption = `scontrol requeue` of the running job; nemo-run's sbatch --requeue lets it come back."""
    run_dir = tmp_path / "run"
    result = submit(load_cluster("ci"), _probe(run_dir, "--steps", "15", "--step-seconds", "0.3"))
    exp = jobs.load_experiment(result.experiment_id)
    _wait_for(lambda: latest_step(run_dir) >= 2, 90, "two steps before preemption")
    job_id = jobs.job_infos(exp)[0].job_id
    subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=20)
    preempted_at = latest_step(run_dir)

    def restarted() -> bool:
        if len(jobs.job_infos(exp)[0].log_files) == 2:
            return True
        # Slurm holds a requeued job back before it may start again; release it (an error, ignored,
        # while the first run is still being torn down).
        subprocess.run(
            ["scontrol", "update", f"JobId={job_id}", "StartTime=now"], capture_output=True, timeout=20
        )
        return False

    _wait_for(restarted, 90, "the requeued job to start again")
    infos = jobs.wait(exp, timeout=120)
    jobs.check_completed(exp, infos)
    assert len(infos[0].log_files) == 2  # one log per run: restart 0 and restart 1
    steps = _steps(run_dir)
    assert steps[-1] == 15 and sorted(set(steps)) == list(range(1, 16))
    restart_log = jobs.read_logs(exp, infos[0]).split("probe: rank 0/1")[-1]
    resumed_after = int(re.search(r"resuming after step (\d+)", restart_log).group(1))
    assert resumed_after >= preempted_at >= 2  # continued from its checkpoint, not from step 1
    assert steps[-(15 - resumed_after) :] == list(range(resumed_after + 1, 16))  # the restarted run's steps


def test_cluster_secret_reaches_the_job_but_no_log(tmp_path, capsys):
    """A token in the cluster file's env is exported in the job, yet neither the dry run, the batch
    script's own log (nemo-run traces it with set -x) nor the job's output shows it."""
    secret, listed = "hf_ci_s3cr3t_4f9a2b7c", "listed-ci-credential-81d3"
    env = {"HF_TOKEN": secret, "MY_CRED": listed, "PLAIN_SETTING": "visible-value"}
    cluster = dataclasses.replace(load_cluster("ci"), env=env, secrets=["MY_CRED"])
    request = _probe(
        tmp_path / "run", "--steps", "1", "--require-env", "HF_TOKEN", "--require-env", "MY_CRED"
    )
    dry = submit(cluster, request, dryrun=True).script
    assert secret not in dry and listed not in dry and "export HF_TOKEN='<redacted>'" in dry

    exp = jobs.load_experiment(submit(cluster, request).experiment_id)
    infos = jobs.wait(exp, timeout=120)
    jobs.check_completed(exp, infos)
    job_log = jobs.read_logs(exp, infos[0])
    batch_logs = sorted(Path(infos[0].job_dir).glob(f"sbatch_*_{infos[0].job_id}.out"))
    assert batch_logs, f"no batch log in {infos[0].job_dir}"
    batch_log = "".join(p.read_text() for p in batch_logs)
    assert "PLAIN_SETTING=visible-value" in batch_log, "the batch log is expected to trace the exports"
    for digest_of, value in (("HF_TOKEN", secret), ("MY_CRED", listed)):
        digest = hashlib.sha256(value.encode()).hexdigest()[:16]
        assert f"probe: {digest_of} is set (sha256 {digest})" in job_log  # delivered intact ...
        assert value not in job_log and value not in batch_log  # ... and never echoed


# ---- the real trainer (`srpo train`, examples/tiny_cpu_test.yaml) -------------------------------------

TINY = REPO / "examples" / "tiny_cpu_test.yaml"


@pytest.mark.skipif(
    not TINY.is_file(), reason="examples/tiny_cpu_test.yaml (the lead's tiny recipe) is absent"
)
def test_srpo_train_cancelled_then_resubmitted_completes_with_continuing_steps(tmp_path, capsys):
    """`srpo launch` of `srpo train` on Slurm: cancel after the first checkpoint, resubmit, COMPLETED.

    The resubmitted job must continue the step counter from `latest`, write metrics for every step up to
    train.steps, and `srpo jobs logs` must show the trainer's output.
    """
    from srpo_megatron.testing.tiny import write_tiny_qwen3

    model = write_tiny_qwen3(tmp_path / "qwen3")
    data = tmp_path / "train.jsonl"
    data.write_text(
        "".join(
            json.dumps(
                {"prompt": f"What is {i} + {i}?", "system": None, "answer": str(2 * i), "kind": "coin"}
            )
            + "\n"
            for i in range(8)
        )
    )
    run_dir = tmp_path / "run"
    overrides = [
        f"model.hf_dir={model}",
        f"data.train_files=[{data}]",
        f"run.dir={run_dir}",
        "train.steps=2",
        "run.tensorboard=false",
    ]
    launch = [
        "launch",
        str(TINY),
        "--cluster",
        "cluster/ci.yaml",
        *(a for o in overrides for a in ("--override", o)),
    ]
    assert commands.main(launch) == 0, capsys.readouterr().err
    _wait_for(lambda: (run_dir / "checkpoints" / "latest").is_file(), 300, "the first checkpoint")
    assert commands.main(["jobs", "cancel"]) == 0
    assert "CANCELLED" in capsys.readouterr().out
    cancelled_at = int((run_dir / "checkpoints" / "latest").read_text().strip().rpartition("_")[2])
    before = _steps(run_dir)
    assert cancelled_at == 1, "the job must be cancelled mid-run, after its first checkpoint"

    rc = commands.main([*launch, "--wait", "--timeout", "400"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    steps = _steps(run_dir)
    assert steps[: len(before)] == before
    assert steps[len(before) :] == [2]
    assert commands.main(["jobs", "logs"]) == 0
    assert '"steps": 2' in capsys.readouterr().out  # the trainer's final summary line
