"""Durable writes: fsync a file, a directory's entries, a whole tree; replace a small text file atomically.

A rename makes a new checkpoint or converter output visible, but only an fsync of the data and then of
the directory makes it survive a crash: without them a power loss can leave the new name pointing at
empty or partial files. The training checkpoints (``trainer/run/checkpoint.py``,
``conversion/checkpoint_files.py``) and the converter's output directories (``conversion/checkpoint.py``)
write through these.

A leaf: standard library only, so every layer may use it (tests/unit/test_import_rules.py).
"""

from __future__ import annotations

import os
from pathlib import Path


def fsync_file(path: Path) -> None:
    """Make one file's data durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (new files, renames) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (before it is renamed into place)."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fsync_file(Path(dirpath) / name)
        fsync_dir(Path(dirpath))


def fsync_dirs(root: Path) -> None:
    """fsync ``root`` and every directory under it (their entries; the files were fsynced already)."""
    for dirpath, _, _ in os.walk(root):
        fsync_dir(Path(dirpath))


def write_text_durably(path: Path, text: str) -> None:
    """Write ``path`` through a temp file: fsync, rename, fsync the directory."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
