"""The converter's O_DIRECT output file (``conversion/write_behind.py``): same bytes as a plain write,
whatever the write sizes, the staging buffer size and the path (direct, or buffered where the filesystem
refuses O_DIRECT), and the writer thread's errors reach the caller."""

from __future__ import annotations

import errno
import fcntl
import os
import random

import pytest

from srpo_megatron.conversion import write_behind
from srpo_megatron.conversion.write_behind import ALIGN, DirectFile


def _chunks(seed: int, total: int) -> list[bytes]:
    """Random bytes in pieces of random sizes (empty, tiny, across buffers, several buffers long)."""
    rng = random.Random(seed)
    out, n = [], 0
    while n < total:
        size = rng.choice([0, 1, 7, ALIGN - 1, ALIGN, ALIGN + 3, 3 * ALIGN + 5, rng.randrange(1, 20 * ALIGN)])
        out.append(rng.randbytes(size))
        n += size
    return out


def _write(path, chunks, buffer_bytes=2 * ALIGN) -> DirectFile:
    with DirectFile(path, buffer_bytes) as f:
        for c in chunks:
            f.write(memoryview(c))
    return f


@pytest.mark.parametrize("buffer_bytes", [ALIGN, 2 * ALIGN, 64 * ALIGN])
@pytest.mark.parametrize("seed", [0, 1])
def test_same_bytes_as_a_plain_write_and_o_direct_used(tmp_path, seed, buffer_bytes):
    chunks = _chunks(seed, 50 * ALIGN + 17)  # ends in a partial block: padded, then truncated
    seen_flags = []
    real_pwrite = write_behind.os.pwrite

    def pwrite(fd, data, offset):
        seen_flags.append(fcntl.fcntl(fd, fcntl.F_GETFL))
        return real_pwrite(fd, data, offset)

    write_behind.os.pwrite = pwrite
    try:
        f = _write(tmp_path / "out", chunks, buffer_bytes)
    finally:
        write_behind.os.pwrite = real_pwrite
    assert (tmp_path / "out").read_bytes() == b"".join(chunks)
    # A healthy write on this machine's filesystem is direct: no fallback, every write with O_DIRECT.
    assert f.direct and f.why_buffered is None
    assert seen_flags and all(flags & os.O_DIRECT for flags in seen_flags)


def test_empty_and_exactly_aligned_files(tmp_path):
    _write(tmp_path / "empty", [])
    assert (tmp_path / "empty").read_bytes() == b""
    data = [random.Random(2).randbytes(4 * ALIGN)]
    _write(tmp_path / "aligned", data)
    assert (tmp_path / "aligned").read_bytes() == data[0]


def test_planted_missing_truncate_is_caught(tmp_path, monkeypatch):
    """The last block is padded for O_DIRECT; without the truncate the file keeps the padding, and the
    byte comparison above fails."""
    monkeypatch.setattr(write_behind.os, "ftruncate", lambda fd, n: None)
    chunks = _chunks(3, 5 * ALIGN + 17)
    _write(tmp_path / "out", chunks)
    got = (tmp_path / "out").read_bytes()
    assert got != b"".join(chunks) and len(got) % ALIGN == 0


def test_buffered_when_the_filesystem_refuses_o_direct_at_open(tmp_path, monkeypatch):
    real_open = write_behind.os.open

    def no_direct_open(path, flags, mode=0o777):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, mode)

    monkeypatch.setattr(write_behind.os, "open", no_direct_open)
    chunks = _chunks(4, 30 * ALIGN + 1)
    f = _write(tmp_path / "out", chunks)
    assert (tmp_path / "out").read_bytes() == b"".join(chunks)
    assert not f.direct and "at open" in f.why_buffered


def test_buffered_when_the_filesystem_refuses_the_first_direct_write(tmp_path, monkeypatch):
    real_pwrite = write_behind.os.pwrite

    def refuses_direct(fd, data, offset):
        if fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(write_behind.os, "pwrite", refuses_direct)
    chunks = _chunks(5, 30 * ALIGN + 1)
    f = _write(tmp_path / "out", chunks)
    assert (tmp_path / "out").read_bytes() == b"".join(chunks)
    assert not f.direct and "writes" in f.why_buffered


def test_a_write_error_reaches_the_caller(tmp_path, monkeypatch):
    """ENOSPC in the writer thread is raised in the caller (at a later write or at close), not lost;
    the file is closed either way."""

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(write_behind.os, "pwrite", full)
    closed = []
    real_close = write_behind.os.close
    monkeypatch.setattr(write_behind.os, "close", lambda fd: closed.append(fd) or real_close(fd))
    with pytest.raises(OSError, match="No space left"):
        _write(tmp_path / "out", _chunks(6, 10 * ALIGN))
    assert len(closed) == 1


def test_an_einval_after_the_first_block_is_an_error_not_a_fallback(tmp_path, monkeypatch):
    """Only the first write may switch to buffered: a refusal later is a real error (a misaligned
    offset would be a bug of ours), raised, never silently rewritten."""
    real_pwrite = write_behind.os.pwrite

    def refuses_later(fd, data, offset):
        if offset:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(write_behind.os, "pwrite", refuses_later)
    with pytest.raises(OSError, match="Invalid argument"):
        _write(tmp_path / "out", _chunks(7, 10 * ALIGN))


def test_buffer_size_must_be_aligned(tmp_path):
    with pytest.raises(ValueError, match="multiple of 4096"):
        DirectFile(tmp_path / "out", ALIGN + 1)
