"""The environment an engine process started from a torchrun worker gets: torchrun's worker variables
cleared (``rollout.sglang.transports.torchrun_worker_vars``). Under torchrun itself:
tests/torchrun/test_torchrun_rendezvous.py."""

from __future__ import annotations

from srpo_megatron.rollout.sglang.transports import torchrun_worker_vars

# The variables torchrun 2.13's agent added to a worker of `torchrun --nproc-per-node 2` (seen), plus the
# job's own.
WORKER_ENV = {
    "RANK": "1",
    "LOCAL_RANK": "1",
    "GROUP_RANK": "0",
    "ROLE_RANK": "1",
    "ROLE_NAME": "default",
    "LOCAL_WORLD_SIZE": "2",
    "WORLD_SIZE": "2",
    "GROUP_WORLD_SIZE": "1",
    "ROLE_WORLD_SIZE": "2",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
    "TORCHELASTIC_RESTART_COUNT": "0",
    "TORCHELASTIC_MAX_RESTARTS": "0",
    "TORCHELASTIC_RUN_ID": "1234",
    "TORCHELASTIC_USE_AGENT_STORE": "True",
    "TORCHELASTIC_ERROR_FILE": "/tmp/x/error.json",
    "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "OMP_NUM_THREADS": "1",
    "CUDA_VISIBLE_DEVICES": "0,1,2,3",
    "PATH": "/usr/bin",
    "PYTHONPATH": "/code",
    "NCCL_SOCKET_IFNAME": "^lo",
}
KEPT = {"TORCH_NCCL_ASYNC_ERROR_HANDLING", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "PATH", "PYTHONPATH"}


def test_torchrun_worker_variables_are_cleared_and_the_rest_kept():
    cleared = torchrun_worker_vars(WORKER_ENV)
    assert set(cleared) == set(WORKER_ENV) - KEPT - {"NCCL_SOCKET_IFNAME"}
    assert "TORCHELASTIC_USE_AGENT_STORE" in cleared and "MASTER_PORT" in cleared
    assert torchrun_worker_vars({"PATH": "/usr/bin"}) == []
