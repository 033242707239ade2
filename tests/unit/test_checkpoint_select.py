"""One resume policy for every reader (``conversion/checkpoint_files.py``): export and ``srpo eval`` pick the
checkpoint train would resume, verified, never one outside the run; and ``run.restart`` acts once per run
directory, keeping only ``keep_last`` moved-aside folders. Checkpoints are plain files with a manifest
written by the trainer's own functions."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from srpo_megatron.conversion.checkpoint_files import (
    RESTART_RECORD,
    CheckpointError,
    checkpoint_to_read,
    digest_files,
    find_resume_checkpoint,
    list_files,
    write_manifest,
)


def _save(run: Path, step: int) -> Path:
    ckpt = run / "checkpoints" / f"step_{step:06d}"
    ckpt.mkdir(parents=True)
    (ckpt / "__0_0.distcp").write_bytes(os.urandom(1024))
    (ckpt / "trainer_state.json").write_text(f'{{"step": {step}}}')
    write_manifest(ckpt, digest_files(ckpt, list_files(ckpt)))
    (run / "checkpoints" / "latest").write_text(ckpt.name + "\n")
    return ckpt


def test_readers_pick_the_newest_complete_checkpoint_and_ignore_an_escaping_latest(tmp_path):
    run = tmp_path / "run"
    older, newest = _save(run, 1), _save(run, 2)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    latest = run / "checkpoints" / "latest"
    for hint in (b"../../elsewhere\n", b"\xff\xfe\x00garbage", b"step_0000"):
        latest.write_bytes(hint)
        lines: list[str] = []
        assert checkpoint_to_read(run, lines.append) == newest
        assert "reading" in lines[0] and str(newest) in lines[0], lines
    assert checkpoint_to_read(latest, lambda _: None) == newest  # the latest file itself
    assert checkpoint_to_read(run / "checkpoints", lambda _: None) == newest
    (newest / "__0_0.distcp").write_bytes(os.urandom(1024))  # same size, other bytes
    with pytest.raises(CheckpointError, match="does not match its SHA-256") as err:
        checkpoint_to_read(newest)
    assert "\n" not in str(err.value)
    assert checkpoint_to_read(run, lambda _: None) == older  # the run: train's fallback
    hf = tmp_path / "hf"
    hf.mkdir()
    assert checkpoint_to_read(hf) == hf  # an HF folder or converter output is read as it is


def _steps_found(run: Path, keep_last: int = 2) -> tuple[Path | None, list[str]]:
    lines: list[str] = []
    return find_resume_checkpoint(run, True, lines.append, keep_last=keep_last), lines


def test_restart_acts_once_and_keeps_keep_last_moved_aside_folders(tmp_path):
    run = tmp_path / "run"
    for stamp in ("20200101-000000", "20200102-000000"):  # two earlier restarts
        (run / f"checkpoints.replaced-{stamp}").mkdir(parents=True)
    _save(run, 3)
    found, lines = _steps_found(run)
    assert found is None and (run / RESTART_RECORD).is_file()
    asides = sorted(p.name for p in run.glob("checkpoints.replaced-*"))
    assert len(asides) == 2 and "checkpoints.replaced-20200101-000000" not in asides
    assert any("removing" in line and "20200101" in line for line in lines), lines
    assert len(list(run.glob("checkpoints.replaced-*/step_000003"))) == 1  # the moved run is kept

    restarted = _save(run, 1)  # what the restarted run saved before its job was requeued
    found, lines = _steps_found(run)  # the requeue passes run.restart=true again
    assert found == restarted
    assert "already acted" in lines[0] and RESTART_RECORD in lines[0]
    assert len(list(run.glob("checkpoints.replaced-*"))) == 2


def test_restart_on_a_fresh_run_is_recorded_so_a_requeue_resumes(tmp_path):
    run = tmp_path / "fresh"
    assert _steps_found(run)[0] is None and (run / RESTART_RECORD).is_file()
    ckpt = _save(run, 5)
    assert _steps_found(run)[0] == ckpt
