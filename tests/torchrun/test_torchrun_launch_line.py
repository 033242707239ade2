"""The torchrun line the torchrun tier runs is the one `srpo launch --cluster cluster/local.yaml` builds."""

from __future__ import annotations

import pytest

from srpo_megatron.launch.experiment import JobCommand, srpo_train_command
from tests.helpers.torchrun import srpo_launch_argv

pytestmark = pytest.mark.torchrun


def test_the_launch_line_is_torchrun_with_the_local_cluster_settings():
    argv, env = srpo_launch_argv(JobCommand("tests.torchrun.workers", ("weights-group",)), 2)
    assert argv[:3] == ["python", "-m", "torch.distributed.run"]  # torchrun's own entry point
    torchrun = argv[3 : argv.index("-m", 3)]
    assert torchrun == ["--standalone", "--nnodes", "1", "--nproc-per-node", "2", "--tee", "3"]
    assert argv[argv.index("-m", 3) :] == ["-m", "tests.torchrun.workers", "weights-group"]
    assert env["SRPO_ROLLOUT_PLACEMENT"] == "colocated" and env["LOGLEVEL"] == "WARNING"


# Values a shell would have to quote: nemo-run's Torchrun launcher shell-quotes them, and torchx's local
# scheduler hands its argv to Popen without a shell, so they reached the job quotes and all.
AWKWARD = ["data.train_files=[/d/a.jsonl]", "rollout.sglang={model_path: /m, tp: 2}", "run.dir=/a b/$HOME"]


@pytest.mark.parametrize("override", AWKWARD)
def test_an_override_that_needs_shell_quoting_reaches_the_job_verbatim(override):
    argv, _ = srpo_launch_argv(srpo_train_command("r.yaml", [override]), 1)
    assert argv[-4:] == ["train", "r.yaml", "--override", override]
