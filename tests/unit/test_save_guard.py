"""trainer/run/save_guard.py: a checkpoint save the disk cannot hold is refused with the path and both sizes,
ENOSPC anywhere in a save is one line naming the path, and the same save failing twice in a row stops
the job (the next start is refused until the space is there). ``shutil.disk_usage`` is monkeypatched: a
real full disk is tests/integration/test_probe_lifecycle.py's tmpfs."""

from __future__ import annotations

import errno
import json
from collections import namedtuple
from pathlib import Path

import pytest

from srpo_megatron.conversion.checkpoint_files import CheckpointError
from srpo_megatron.trainer.run import save_guard
from srpo_megatron.trainer.run.save_guard import FAILURE_FILE, guarded_save, save_failure_problem

Usage = namedtuple("Usage", "total used free")


def _previous_checkpoint(run: Path, step: int, size: int) -> Path:
    ckpt = run / "checkpoints" / f"step_{step:06d}"
    ckpt.mkdir(parents=True)
    (ckpt / "shard").write_bytes(b"x" * size)
    manifest = {"format": 1, "files": {"shard": {"size": size, "sha256": "-"}}}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    return ckpt


@pytest.fixture
def free(monkeypatch):
    """Set the free bytes every ``shutil.disk_usage`` in save_guard reports."""
    box = {"free": 0}
    monkeypatch.setattr(save_guard.shutil, "disk_usage", lambda _: Usage(10**12, 0, box["free"]))
    return box


def test_save_refused_when_free_space_is_below_the_previous_checkpoint(tmp_path, free):
    run = tmp_path / "run"
    previous = _previous_checkpoint(run, 1, 1000)
    needed = 1000 + (previous / "manifest.json").stat().st_size
    free["free"] = 500
    saved = []
    with pytest.raises(CheckpointError) as e, guarded_save(run, 2, log=print):
        saved.append(2)
    assert not saved  # refused before writing anything
    assert str(e.value) == (
        f"not saving checkpoint step 2: {run / 'checkpoints'} has 500 bytes free, the previous checkpoint "
        f"{previous} takes {needed} bytes; free space there and rerun; the next "
        f"start is refused until it can succeed ({run / FAILURE_FILE})"
    )
    problem = save_failure_problem(run)  # a requeue would fail the same way: it does not start
    why = str(e.value).split("; the next")[0]
    assert problem == (
        f"{run / FAILURE_FILE}: the save of step 2 failed 1 time(s) in a row ({why}); {run / 'checkpoints'} "
        f"still has 500 bytes free, {needed} needed; not starting again: fix the cause, then delete that file"
    )
    free["free"] = needed
    notes: list[str] = []
    assert save_failure_problem(run, log=notes.append) is None and "retrying" in notes[0]  # space freed
    with guarded_save(run, 2, log=print):
        saved.append(2)
    assert saved == [2]
    assert not (run / FAILURE_FILE).exists()  # a successful save clears the record


def test_enospc_in_a_save_is_one_line_naming_the_path_and_the_next_start_waits_for_space(tmp_path, free):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    tmp = run / "checkpoints" / "step_000003.tmp"
    free["free"] = 10**9

    def failing_save() -> None:
        tmp.mkdir(exist_ok=True)
        (tmp / "part").write_bytes(b"x" * 10)
        raise RuntimeError("Worker failure") from OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(CheckpointError) as first, guarded_save(run, 3):
        failing_save()
    assert str(first.value) == (
        f"saving checkpoint step 3 to {tmp} failed: no space left on device ({run / 'checkpoints'}); free "
        f"space there and rerun; the next start is refused until it can succeed ({run / FAILURE_FILE})"
    )
    assert not tmp.exists()  # removed: the disk is not left full
    problem = save_failure_problem(run)
    assert problem is not None and f"still has {10**9} bytes free, {10**9 + 1} needed" in problem
    free["free"] = 10**9 + 1  # more room than the failed attempt had: the next start tries again
    assert save_failure_problem(run) is None


def test_another_save_failure_twice_in_a_row_stops_the_job(tmp_path, free):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    free["free"] = 10**9
    for count in (1, 2):
        with pytest.raises(CheckpointError) as e, guarded_save(run, 5):
            raise OSError(errno.EIO, "Input/output error")
        assert (f"failed {count} times in a row" in str(e.value)) == (count == 2), str(e.value)
        assert (save_failure_problem(run) is None) == (count == 1)  # once: a requeue may try again
    problem = save_failure_problem(run)
    assert problem is not None and "the save of step 5 failed 2 time(s) in a row" in problem


def test_bare_torch_write_failure_on_a_full_disk_is_named_no_space(tmp_path, free):
    """torch's zip writer names neither errno nor path: on a filesystem with nothing left it is ENOSPC."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    free["free"] = 0
    with pytest.raises(CheckpointError, match="failed: no space left on device"), guarded_save(run, 1):
        raise RuntimeError(
            "Worker failure: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"
        )
    free["free"] = 10**9  # the same message with room to spare is some other failure, named as it is
    with (
        pytest.raises(CheckpointError, match=r"failed \(RuntimeError: Worker failure: \[enforce"),
        guarded_save(run, 1),
    ):
        raise RuntimeError("Worker failure: [enforce fail at inline_container.cc:672] . unexpected pos")
