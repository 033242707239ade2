"""Choosing a TCP port for a rendezvous that binds it later (a TCPStore, a broadcast group's store).

A port taken from ``bind(("", 0))`` and released comes from the kernel's *ephemeral* range, the same range
the kernel draws every outgoing connection's source port and every other ``bind(0)`` from. Between the
choice and the store's own bind, which may be minutes later (model build, a training step), a gloo or NCCL
connection can take it: ``DistNetworkError ... EADDRINUSE``. Found in CI: a TP2×PP2 weight-sync test lost
its stage channel's port to its own ranks' gloo connections.

``free_port`` therefore picks a port *below* the ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``,
32768–60999 by default on Linux), which nothing takes implicitly, at random so that concurrent callers
rarely collide, and checks that it is free now. Only an explicit bind of the same port by another process
can still race, which two callers drawing from ~16k ports makes unlikely.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_DEFAULT_EPHEMERAL = (32768, 60999)
_LOWEST = 10000  # below: well-known and registered services (Slurm 6817-6819, ...)


def ephemeral_range(path: Path = _RANGE_FILE) -> tuple[int, int]:
    """The kernel's ephemeral port range (inclusive); Linux's default where the file is unreadable."""
    try:
        lo, hi = (int(x) for x in path.read_text().split())
    except (OSError, ValueError):
        return _DEFAULT_EPHEMERAL
    return lo, hi


def candidate_range(ephemeral: tuple[int, int]) -> range:
    """Ports outside ``ephemeral`` to draw from: below it when there is room, else above it."""
    lo, hi = ephemeral
    if lo - _LOWEST >= 1024:
        return range(_LOWEST, lo)
    if 65535 - hi >= 1024:
        return range(hi + 1, 65536)
    raise RuntimeError(
        f"no room for rendezvous ports outside the ephemeral range {lo}-{hi} ({_RANGE_FILE}); "
        f"narrow net.ipv4.ip_local_port_range to leave >= 1024 ports free below or above it"
    )


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "", attempts: int = 256) -> int:
    """A port on ``host`` (all interfaces by default) that is free now and outside the ephemeral range."""
    ports = candidate_range(ephemeral_range())
    rng = random.SystemRandom()
    for _ in range(attempts):
        port = rng.choice(ports)
        if _bindable(host, port):
            return port
    raise RuntimeError(
        f"no free port found in {ports.start}-{ports.stop - 1} after {attempts} tries on host {host!r}; "
        "check for a process holding many listening sockets"
    )
