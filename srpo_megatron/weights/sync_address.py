"""The address separately placed SGLang servers reach a stage sender at (the broadcast group's store).

``socket.gethostbyname(socket.gethostname())`` is no answer: Debian-style images map the host name to
127.0.1.1 in /etc/hosts, which no other host can reach. In order:

1. ``SRPO_SYNC_HOST``, when set;
2. the IPv4 address of the interface ``GLOO_SOCKET_IFNAME`` names (gloo's syntax: comma-separated exact
   names), else of the one ``NCCL_SOCKET_IFNAME`` names (NCCL's syntax: a name prefix, or ``=name`` for
   an exact name; an exclusion list such as ``^lo,docker0`` names no interface and is skipped);
3. the source address the OS would use to reach the first server (a UDP ``connect``: no packet is sent);
4. this host's name resolved — refused when it is a loopback address but a server is on another host.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Mapping, Sequence
from urllib.parse import urlparse

from srpo_megatron.rollout.base import EngineError


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def interface_ipv4(spec: str, nccl_syntax: bool = False) -> tuple[str, str] | None:
    """``(interface, IPv4 address)`` of the first interface ``spec`` names that has one; None when the
    spec names none (NCCL exclusion lists). Raises when it names interfaces of which none has one."""
    import psutil

    items = [x.strip() for x in spec.split(",") if x.strip()]
    if not items or (nccl_syntax and spec.lstrip().startswith("^")):
        return None
    addrs = psutil.net_if_addrs()

    def named(iface: str, item: str) -> bool:
        if not nccl_syntax:
            return iface == item
        return iface == item[1:] if item.startswith("=") else iface.startswith(item)

    for item in items:
        for iface in sorted(addrs):
            if named(iface, item):
                ipv4 = [a.address for a in addrs[iface] if a.family == socket.AF_INET]
                if ipv4:
                    return iface, ipv4[0]
    raise EngineError(
        f"the socket interface setting {spec!r} names no interface with an IPv4 address on this host "
        f"(interfaces: {sorted(addrs)}); set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to one of them, "
        "or SRPO_SYNC_HOST to the address the SGLang servers reach this host at"
    )


def route_source(host: str, port: int) -> str | None:
    """The local address the OS routes to ``host:port`` from (UDP connect sends nothing); None when
    there is no route or the name does not resolve."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return s.getsockname()[0]
    except OSError:
        return None


def sync_address(server_urls: Sequence[str], env: Mapping[str, str] | None = None) -> str:
    """The address the servers at ``server_urls`` reach this sender at (module docstring: the order)."""
    env = os.environ if env is None else env
    if env.get("SRPO_SYNC_HOST"):
        return env["SRPO_SYNC_HOST"]
    for key in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if env.get(key):
            found = interface_ipv4(env[key], nccl_syntax=key.startswith("NCCL"))
            if found:
                return found[1]
    hosts = [urlparse(u).hostname or "" for u in server_urls]
    if hosts:
        port = urlparse(server_urls[0]).port or 80
        source = route_source(hosts[0], port)
        if source:
            return source
    address = socket.gethostbyname(socket.gethostname())
    remote = [h for h in hosts if not _is_loopback(h)]
    if _is_loopback(address) and remote:
        raise EngineError(
            f"this host's name resolves to the loopback address {address}, which the SGLang servers on "
            f"{remote} cannot reach; set SRPO_SYNC_HOST to this host's routable address (or "
            "GLOO_SOCKET_IFNAME to its interface)"
        )
    return address
