"""`srpo jobs status|logs|cancel`: inspect experiments that `srpo launch` submitted.

Experiments are found in nemo-run's home (``$NEMORUN_HOME``, default ``~/.nemo_run``) by id
(``srpo-qwen3_8b_srpo_1795...``), by title (the latest run of it) or, with no argument, the latest
experiment overall. For Slurm jobs the state is Slurm's own word from ``sacct`` (COMPLETED, FAILED,
CANCELLED, TIMEOUT, PREEMPTED, REQUEUED, ...: more precise than nemo-run's SUCCEEDED/FAILED), read
through the experiment's tunnel so that it works from a laptop over SSH as well as on the login node.
Logs are the job's own output files (one per Slurm restart), read through the same tunnel.
"""

from __future__ import annotations

import os
import re
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path

from srpo_megatron.config import ConfigError
from srpo_megatron.launch.nemo_import import import_nemo_run

# Slurm states after which a job will not run again (REQUEUED/PREEMPTED jobs come back as PENDING).
FINAL_STATES = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL", "DEADLINE"}
)


class JobError(RuntimeError):
    """A launched job did not complete; the message holds its state and the tail of its log."""


def set_home(home: str | Path | None = None) -> Path:
    """Point nemo-run at ``home`` and return it; None keeps nemo-run's current home.

    nemo-run's home starts as ``$NEMORUN_HOME`` (default ``~/.nemo_run``); experiments, their sbatch
    scripts and (on a login node) their logs live under ``<home>/experiments``.
    """
    import_nemo_run()  # without torch (see launch/nemo_import.py)
    from nemo_run.config import get_nemorun_home, set_nemorun_home

    if home is not None:
        set_nemorun_home(str(Path(home).expanduser()))
    return Path(get_nemorun_home())


def experiment_ids(home: Path) -> list[str]:
    """All experiment ids under ``home``, oldest first (ids end in a nanosecond timestamp)."""
    root = home / "experiments"
    ids = [d.name for d in root.glob("*/*") if (d / "_CONFIG").is_file()] if root.is_dir() else []
    return sorted(ids, key=lambda i: int(i.rpartition("_")[2]) if i.rpartition("_")[2].isdigit() else 0)


def load_experiment(ref: str | None = None, home: str | Path | None = None):
    """The nemo-run Experiment named by ``ref`` (id or title; None: the latest one)."""
    run = import_nemo_run()

    root = set_home(home)
    ids = experiment_ids(root)
    if not ids:
        raise ConfigError(f"no experiments under {root}; submit one with `srpo launch` (or pass --home)")
    if ref is None:
        exp_id = ids[-1]
    elif ref in ids:
        exp_id = ref
    else:
        matching = [i for i in ids if i.rpartition("_")[0] == ref]
        if not matching:
            raise ConfigError(f"no experiment with id or title {ref!r} under {root}; latest ones: {ids[-5:]}")
        exp_id = matching[-1]
    return run.Experiment.from_id(exp_id)


@dataclass
class JobInfo:
    """One task of an experiment as `srpo jobs` reports it."""

    experiment_id: str
    name: str  # the task name
    job_id: str  # Slurm job id ("" for local jobs)
    state: str  # Slurm state (sacct) for Slurm jobs, nemo-run's AppState name otherwise
    job_dir: str  # directory that holds the job's logs (on the cluster for SSH tunnels)
    log_files: list[str] = field(default_factory=list)  # the command's output, one file per restart

    @property
    def finished(self) -> bool:
        if self.job_id:  # Slurm: sacct lags submission, so an unknown state is not an end
            return self.state in FINAL_STATES
        return self.state in ("SUCCEEDED", "FAILED", "CANCELLED", "UNKNOWN")


def _tunnel_run(tunnel, cmd: str) -> str:
    result = tunnel.run(cmd, hide=True, warn=True)
    return result.stdout if result is not None else ""


def _is_slurm(job) -> bool:
    import_nemo_run()  # without torch (see launch/nemo_import.py)
    from nemo_run import SlurmExecutor

    return isinstance(job.executor, SlurmExecutor)


def _slurm_job_dir(job) -> str:
    tunnel = job.executor.tunnel
    if not tunnel.job_dir:
        return job.executor.job_dir
    return os.path.join(tunnel.job_dir, Path(job.executor.job_dir).name)


def _slurm_state(tunnel, job_id: str) -> str:
    # -X: the allocation only (not its steps); a requeued job has one line per run, the last is current.
    out = _tunnel_run(tunnel, f"sacct -X -n -P -o State -j {shlex.quote(job_id)}")
    lines = [ln.split()[0] for ln in out.splitlines() if ln.strip()]
    if lines:
        return lines[-1]
    # sacct lags submission by a moment; squeue already knows the job then.
    out = _tunnel_run(tunnel, f"squeue -h -o %T -j {shlex.quote(job_id)}").strip()
    return out.split()[0] if out else "UNKNOWN"


def job_infos(exp) -> list[JobInfo]:
    """State and log files of every task of ``exp``."""
    infos = []
    local_status = None
    for job in exp.jobs:
        _, _, path = (job.handle or "").partition("://")
        parts = path.split("/")
        job_id = parts[1] if len(parts) > 1 else ""
        if _is_slurm(job) and job_id:
            tunnel = job.executor.tunnel
            job_dir = _slurm_job_dir(job)
            state = _slurm_state(tunnel, job_id)
            pattern = os.path.join(job_dir, f"log-*_{job_id}_*.out")
            listing = _tunnel_run(tunnel, f"ls -1 {pattern} 2>/dev/null")
            # Order by restart count (the number before .out), so a requeued job's runs read in order.
            logs = sorted(listing.split(), key=lambda p: int(p.rsplit("_", 1)[1].split(".")[0]))
            if not logs:  # the job failed before its command started: the batch script's own log
                batch_log = os.path.join(job_dir, f"sbatch_*_{job_id}.out")
                logs = _tunnel_run(tunnel, f"ls -1 {batch_log} 2>/dev/null").split()
        else:
            if local_status is None:
                local_status = exp.status(return_dict=True) or {}
            state = str(local_status.get(job.id, {}).get("status", "UNKNOWN")).split(".")[-1]
            job_dir = job.executor.job_dir
            # torchx's local scheduler: <job_dir>/nemo_run/<app id>/<role>/<replica>/combined.log
            logs = sorted(str(p) for p in Path(job_dir).glob("nemo_run/*/*/*/combined.log"))
            job_id = ""
        infos.append(JobInfo(exp._id, job.id, job_id, state, job_dir, logs))
    return infos


def read_logs(exp, info: JobInfo, tail: int | None = None) -> str:
    """The job's output (all restarts, in order); only the last ``tail`` lines when given."""
    job = next(j for j in exp.jobs if j.id == info.name)
    if not info.log_files:
        return ""
    files = " ".join(shlex.quote(f) for f in info.log_files)
    if _is_slurm(job):
        cmd = f"cat {files}" + (f" | tail -n {int(tail)}" if tail else "")
        return _tunnel_run(job.executor.tunnel, cmd)
    text = "".join(Path(f).read_text(errors="replace") for f in info.log_files)
    return "\n".join(text.splitlines()[-tail:]) + "\n" if tail else text


def wait(exp, timeout: float = 3600.0, poll: float = 1.0) -> list[JobInfo]:
    """Block until every task of ``exp`` reached a final state; return their infos."""
    deadline = time.monotonic() + timeout
    while True:
        infos = job_infos(exp)
        if all(i.finished for i in infos):
            return infos
        if time.monotonic() > deadline:
            states = {i.name: i.state for i in infos}
            raise TimeoutError(f"experiment {exp._id} not finished after {timeout:.0f} s: {states}")
        time.sleep(poll)


# A worker's exception line as torchrun --tee prefixes it: "[default0]:RuntimeError: ...".
_WORKER_ERROR = re.compile(r"^\[\w+?\d+\]:[\w.]*(Error|Exception)\b.*$", re.M)


_ROOT_CAUSE_RANK = re.compile(r"Root Cause \(first observed failure\):.*?rank\s*:\s*(\d+)", re.S)
_RANK_ERROR = r"^\[\w+?{rank}\]:(?:srpo [\w-]+: error: .*|[\w.]*(?:Error|Exception)\b.*)$"


def first_failing_rank(log: str, job_dir: str) -> str | None:
    """``rank N: <its last error line> (log: <its stderr.log>)`` for torchrun's first failing rank (its
    "Root Cause"), or None when the log names none. Torchrun's own traceback fills the log's end; the
    rank's one-line refusal (``srpo train: error: ...``) or exception sits higher, among every rank's."""
    cause = _ROOT_CAUSE_RANK.search(log)
    if cause is None:
        return None
    rank = cause.group(1)
    lines = re.findall(_RANK_ERROR.format(rank=rank), log, re.M)
    files = sorted(Path(job_dir).glob(f"**/torchelastic/**/attempt_*/{rank}/stderr.log"))
    where = f" (log: {files[-1]})" if files else ""
    said = lines[-1].split("]:", 1)[1] if lines else "no error line in the log"
    return f"first failing rank {rank}: {said}{where}"


def check_completed(exp, infos: list[JobInfo], tail: int = 40) -> None:
    """Raise :class:`JobError` with state and log tail for every task that did not complete.

    torchrun's own traceback fills the last ~30 lines of a failed job's log, so the first worker
    exception is quoted on its own line as well.
    """
    bad = [i for i in infos if i.state not in ("COMPLETED", "SUCCEEDED")]
    if bad:
        parts = []
        for i in bad:
            log = read_logs(exp, i).rstrip()
            error = _WORKER_ERROR.search(log)
            rank = first_failing_rank(log, i.job_dir) if not i.job_id else None
            last = "\n".join(log.splitlines()[-tail:]) or "(no log output)"
            parts.append(
                f"job {i.name} (Slurm id {i.job_id or '-'}) of experiment {i.experiment_id} ended {i.state}"
                + (f"\n{rank}" if rank else "")
                + (f"\nfirst worker error: {error.group(0)}" if error and not rank else "")
                + f"\nlast {tail} log lines ({', '.join(i.log_files) or 'no log file'}):\n{last}"
            )
        raise JobError("\n\n".join(parts))


def cancel(exp, timeout: float = 60.0) -> list[JobInfo]:
    """Cancel every task of ``exp`` that is still pending or running; return the infos once they ended.

    scancel only asks Slurm to stop the job, so this waits (up to ``timeout``) until sacct shows the end.
    """
    for info in job_infos(exp):
        if not info.finished:
            exp.cancel(info.name)
    return wait(exp, timeout=timeout, poll=0.5)
