"""free_port: rendezvous ports come from outside the kernel's ephemeral range (srpo_megatron/ports.py).

The CI failure it guards against: a port chosen with bind(0) (ephemeral) was taken by a gloo connection's
source port before the TCPStore bound it (EADDRINUSE).
"""

from __future__ import annotations

import socket

import pytest

from srpo_megatron import ports


def _old_free_port() -> int:  # the planted bug: what the three copies did before
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _outside(port: int, rng: tuple[int, int]) -> bool:
    return not rng[0] <= port <= rng[1]


def test_free_port_is_outside_the_ephemeral_range_and_bindable():
    eph = ports.ephemeral_range()
    for _ in range(50):
        port = ports.free_port("127.0.0.1")
        assert _outside(port, eph) and port >= 10000
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free right now


def test_the_planted_bind_zero_picker_is_caught():
    eph = ports.ephemeral_range()
    assert not _outside(_old_free_port(), eph)


def test_a_connection_source_port_never_lands_on_a_chosen_port():
    """What actually raced: outgoing connections draw source ports from the ephemeral range only."""
    eph = ports.ephemeral_range()
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(64)
        clients = [socket.create_connection(server.getsockname()) for _ in range(32)]
        try:
            assert all(not _outside(c.getsockname()[1], eph) for c in clients)
        finally:
            for c in clients:
                c.close()


def test_range_file_parsing_and_fallbacks(tmp_path):
    f = tmp_path / "range"
    f.write_text("40000\t50000\n")
    assert ports.ephemeral_range(f) == (40000, 50000)
    assert ports.candidate_range((40000, 50000)) == range(10000, 40000)
    assert ports.ephemeral_range(tmp_path / "missing") == (32768, 60999)
    f.write_text("garbage")
    assert ports.ephemeral_range(f) == (32768, 60999)
    # an ephemeral range starting low: draw above it
    assert ports.candidate_range((1024, 60000)) == range(60001, 65536)
    with pytest.raises(RuntimeError, match="ip_local_port_range"):
        ports.candidate_range((1024, 65000))


def test_occupied_ports_are_skipped(monkeypatch):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    port = taken.getsockname()[1]
    try:
        monkeypatch.setattr(ports, "candidate_range", lambda _: range(port, port + 1))
        with pytest.raises(RuntimeError, match="no free port"):
            ports.free_port("127.0.0.1", attempts=4)
    finally:
        taken.close()
