"""A trainer checkpoint save logs nothing about an "old incomplete / corrupted checkpoint".

megatron-core's ``dist_checkpointing.save`` logs "Overwriting old incomplete / corrupted checkpoint..." on
rank 0 when the folder it is given is not empty (``serialization.save``: ``next(iterdir())``). The trainer
used to create ``rng/`` inside the temporary folder before the save, so every demo save printed it.
``save_checkpoint`` now hands megatron an empty folder and writes its own files after; the planted variant
(a file in the folder before megatron's save) shows the capture sees the message.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from srpo_megatron.testing.distributed import run_distributed
from tests.helpers.trainer import tiny_policy, tiny_step, write_tiny_policy_run

MESSAGE = "Overwriting old incomplete / corrupted checkpoint"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_tiny_policy_run(tmp_path_factory.mktemp("tiny_save_log"))


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _save(rank, world, tiny, run_dir, plant):
    from megatron.core import dist_checkpointing

    from srpo_megatron.trainer.run.checkpoint import save_checkpoint
    from srpo_megatron.conversion.checkpoint_files import verify_checkpoint

    records = _Records()
    logging.getLogger("megatron.core.dist_checkpointing.serialization").addHandler(records)
    policy = tiny_policy(tiny, run_dir, [])
    tiny_step(policy, rank, 0)
    if plant:  # what the old save did: something in the folder before megatron's save starts
        real = dist_checkpointing.save

        def planted(state, folder, *a, **kw):
            (Path(folder) / "rng").mkdir(exist_ok=True)
            return real(state, folder, *a, **kw)

        dist_checkpointing.save = planted
    final = save_checkpoint(policy, run_dir, 1, {"weight_version": 2}, keep_last=1)
    return records.messages, verify_checkpoint(final), sorted(p.name for p in (final / "rng").iterdir())


@pytest.mark.parametrize("world", [1, 2])
def test_save_logs_no_overwriting_of_an_old_checkpoint(tiny, tmp_path, world):
    out = run_distributed(_save, world, tiny, str(tmp_path / "run"), False, timeout=900)
    messages, problem, rng_files = out[0]
    assert not [m for m in messages if MESSAGE in m], messages
    assert problem is None, problem  # the manifest covers the files written after megatron's save
    assert rng_files == [f"rank_{r:05d}.pt" for r in range(world)]


def test_a_non_empty_folder_before_the_save_is_reported(tiny, tmp_path):
    messages, problem, _ = run_distributed(_save, 1, tiny, str(tmp_path / "run"), True, timeout=900)[0]
    assert [m for m in messages if MESSAGE in m], "the planted non-empty folder was not reported"
    assert problem is None
