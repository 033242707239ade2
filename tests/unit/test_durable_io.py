"""``durable_io.reserve_space``: blocks reserved up front with fallocate(2), never emulated by writing."""

from __future__ import annotations

import os

from srpo_megatron import durable_io


def test_reserve_space_allocates_blocks(tmp_path):
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
    try:
        assert durable_io.reserve_space(fd, 3 << 20)
        st = os.fstat(fd)
        assert st.st_size == 3 << 20
        assert st.st_blocks * 512 >= 3 << 20  # allocated, not a sparse size change
        assert not durable_io.reserve_space(fd, 0)
    finally:
        os.close(fd)


def test_reserve_space_is_best_effort(tmp_path, monkeypatch):
    """Where fallocate is refused (a device, a file system without it) or missing, nothing is written and
    False says so: the caller writes as it would have."""
    with open(os.devnull, "wb") as f:
        assert not durable_io.reserve_space(f.fileno(), 4096)
    monkeypatch.setattr(durable_io, "_fallocate", None)
    fd = os.open(tmp_path / "g", os.O_WRONLY | os.O_CREAT)
    try:
        assert not durable_io.reserve_space(fd, 4096)
        assert os.fstat(fd).st_size == 0
    finally:
        os.close(fd)
