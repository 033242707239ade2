"""Durable writes: fsync a file, a directory's entries, a whole tree; replace a small text file atomically;
reserve a large file's blocks before writing it.

A rename makes a new checkpoint or converter output visible, but only an fsync of the data and then of
the directory makes it survive a crash: without them a power loss can leave the new name pointing at
empty or partial files. The training checkpoints (``trainer/run/checkpoint.py``,
``conversion/checkpoint_files.py``) and the converter's output directories (``conversion/checkpoint.py``)
write through these.

A leaf: standard library only, so every layer may use it (tests/unit/test_import_rules.py).
"""

from __future__ import annotations

import ctypes
import ctypes.util
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


def reserve_space(fd: int, nbytes: int) -> bool:
    """Allocate ``nbytes`` of disk blocks for ``fd`` up front (Linux ``fallocate(2)``, mode 0; the file's
    size grows to ``nbytes``: truncate it to what was written). True if the blocks were reserved.

    Why: on ext4 (delayed allocation) every ``write`` into a new part of a file reserves its blocks page
    by page; with the extent allocated first, the same writes ran in half the time
    (``conversion/stream_writer.py``, measured in tools/MEASURED.md). Best effort: a file system without
    ``fallocate`` (or a full disk, which the writes themselves then report) leaves the file as it was.
    Not ``os.posix_fallocate``: where the file system lacks ``fallocate``, glibc emulates it by writing
    every block, doubling the I/O it was meant to save."""
    if nbytes <= 0 or _fallocate is None:
        return False
    return _fallocate(fd, 0, 0, nbytes) == 0


def _libc_fallocate():
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).fallocate
    except (OSError, AttributeError):  # not glibc/Linux: no reservation, writes as before
        return None
    fn.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
    fn.restype = ctypes.c_int
    return fn


_fallocate = _libc_fallocate()
