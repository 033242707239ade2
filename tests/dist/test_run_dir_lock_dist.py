"""The run-directory lock under a two-rank job (issue 30, failure 6): only global rank 0 takes it, rank 1
gets rank 0's verdict instead of refusing its own job's lock, and another process is still refused."""

from __future__ import annotations

from pathlib import Path

from srpo_megatron.testing.distributed import run_distributed


def _claim(rank: int, world: int, run_dir: str) -> tuple[bool, bool]:
    import torch.distributed as dist

    from srpo_megatron.trainer.run import run_dir as rd

    rd.claim_run_dir(run_dir)  # every rank: none raises
    held = bool(rd._HELD)
    dist.barrier()
    refused = rank == 1 and rd.lock_run_dir(run_dir) is not None  # as a second trainer on this node would
    dist.barrier()
    rd.release_run_dir(run_dir)
    return held, refused


def test_ranks_of_one_job_share_rank_0s_lock(tmp_path: Path):
    assert run_distributed(_claim, 2, str(tmp_path / "run")) == [(True, False), (False, True)]
