"""Private ``tcp://`` rendezvous inside torchrun workers (issue D1), run under `srpo launch`'s torchrun line.

torchrun exports ``TORCHELASTIC_USE_AGENT_STORE=True`` to its workers; torch's tcp:// handler then makes
every rank, rank 0 included, a client of a store nobody hosts. The multiprocessing test harness sets no
such variable, so only a real torchrun shows it.
"""

from __future__ import annotations

import json

import pytest

from srpo_megatron.launch.experiment import JobCommand
from srpo_megatron.rollout.sglang.transports import torchrun_worker_vars
from tests.helpers.torchrun import check, run_torchrun, srpo_launch_argv

pytestmark = pytest.mark.torchrun

RENDEZVOUS_S = 10  # each rendezvous' own timeout: the failing ones end after it
TIMEOUT_S = 300  # the whole torchrun run (a hang is killed here and fails the test)
# Added to a worker's environment by torchrun and kept for an engine child on purpose.
KEPT = {"TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS"}


def _results(output: str) -> list[dict]:
    rows = [json.loads(line.partition("RESULT ")[2]) for line in output.splitlines() if "RESULT " in line]
    return sorted(rows, key=lambda r: r["rank"])


def _run(*args: str, nprocs: int = 1) -> list[dict]:
    cmd = JobCommand("tests.torchrun.workers", (*args, "--timeout", str(RENDEZVOUS_S)))
    return _results(check(run_torchrun(cmd, nprocs, TIMEOUT_S)))


def test_the_weights_group_listens_under_torchrun_where_a_bare_tcp_rendezvous_does_not():
    (r,) = _run("weights-group")
    assert r["group_world"] == 1, "init_weights_group returned a group"
    # The canary: if it starts to pass, torch changed the tcp:// handler under torchrun (upstream PRs).
    assert "timed out" in r["bare_rendezvous"], r["bare_rendezvous"]


def test_an_engine_child_of_a_torchrun_worker_starts_its_own_tcp_world(tmp_path):
    """The child clears torchrun's worker variables: its scheduler-like rendezvous succeeds, and its
    environment holds none of what torchrun added except the kept tuning variables. With the variables
    inherited (the bug planted back) the same child fails its rendezvous with a client-socket timeout."""
    (ok,) = _run("engine-child")
    assert ok["started"], ok.get("error")
    added = set(ok["worker_env"]) - set(_parent_env())
    assert "TORCHELASTIC_USE_AGENT_STORE" in added
    assert added - set(torchrun_worker_vars(dict.fromkeys(added, ""))) <= KEPT | {"PYTHONUNBUFFERED"}, (
        "torchrun added a variable the engine child does not clear: decide whether SGLang misreads it"
    )
    assert not set(ok["child_env"]) & set(torchrun_worker_vars(dict.fromkeys(added, "")))
    (planted,) = _run("engine-child", "--keep-torchrun-env")
    assert not planted["started"] and "timed out" in planted["error"], planted


def _parent_env() -> dict[str, str]:
    import os

    _, job_env = srpo_launch_argv(JobCommand("tests.torchrun.workers"), 1)
    return {**os.environ, **job_env}
