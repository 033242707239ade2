"""The torchrun line the torchrun tier runs is the one `srpo launch --cluster cluster/local.yaml` builds."""

from __future__ import annotations

import pytest

from srpo_megatron.launch.experiment import JobCommand, srpo_train_command
from tests.torchrun.launch import srpo_launch_argv

pytestmark = pytest.mark.torchrun


def test_the_launch_line_is_torchrun_with_the_local_cluster_settings():
    argv, env = srpo_launch_argv(JobCommand("tests.torchrun.workers", ("weights-group",)), 2)
    assert argv[0] == "torchrun" and argv[argv.index("--nproc-per-node") + 1] == "2"
    assert argv[argv.index("--rdzv-endpoint") + 1] == "localhost:0"  # single node: a free port
    assert argv[argv.index("-m") :] == ["-m", "tests.torchrun.workers", "weights-group"]
    assert env["SRPO_ROLLOUT_PLACEMENT"] == "colocated" and env["LOGLEVEL"] == "WARNING"


@pytest.mark.xfail(
    strict=True,
    reason="nemo-run shell-quotes torchrun's arguments and its local scheduler passes them to Popen "
    "quotes and all: `srpo launch --cluster local -o 'data.train_files=[x]'` reaches srpo train as "
    "\"'data.train_files=[x]'\" (seen: 'the value is not valid YAML')",
)
def test_an_override_with_yaml_brackets_reaches_the_job_verbatim():
    argv, _ = srpo_launch_argv(srpo_train_command("r.yaml", ["data.train_files=[/d/a.jsonl]"]), 1)
    assert argv[-2:] == ["--override", "data.train_files=[/d/a.jsonl]"]
