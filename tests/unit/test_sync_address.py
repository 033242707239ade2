"""The address separately placed SGLang servers reach a stage sender at (``weights.sync_address``), and the
cluster file's gloo interface that feeds it on a GPU cluster."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from srpo_megatron.config import load_cluster
from srpo_megatron.launch.experiment import LaunchRequest, _job_env, srpo_train_command
from srpo_megatron.rollout.base import EngineError
from srpo_megatron.weights import sync_address as sa

REPO = Path(__file__).resolve().parents[2]
REMOTE = ["http://10.11.12.13:30000", "http://10.11.12.14:30000"]


def test_srpo_sync_host_wins():
    env = {"SRPO_SYNC_HOST": "10.0.0.7", "GLOO_SOCKET_IFNAME": "lo"}
    assert sa.sync_address(REMOTE, env) == "10.0.0.7"


def test_the_interface_gloo_names_gives_the_address():
    assert sa.sync_address(REMOTE, {"GLOO_SOCKET_IFNAME": "lo"}) == "127.0.0.1"
    assert sa.sync_address(REMOTE, {"GLOO_SOCKET_IFNAME": "nope0,lo"}) == "127.0.0.1"  # a list: first found
    # NCCL's syntax: a prefix or "=exact"; an exclusion list names nothing and falls through to the route
    assert sa.sync_address(REMOTE, {"NCCL_SOCKET_IFNAME": "l"}) == "127.0.0.1"
    assert sa.sync_address(REMOTE, {"NCCL_SOCKET_IFNAME": "=lo"}) == "127.0.0.1"
    assert sa.interface_ipv4("^lo,docker0", nccl_syntax=True) is None
    with pytest.raises(EngineError, match=r"'nope0' names no interface .*SRPO_SYNC_HOST"):
        sa.sync_address(REMOTE, {"GLOO_SOCKET_IFNAME": "nope0"})


def test_the_route_to_the_first_server_gives_the_address():
    """No setting: the source address of the route to the first server (a local server: loopback)."""
    assert sa.sync_address(["http://127.0.0.1:30000"], {}) == "127.0.0.1"
    routed = sa.route_source("10.11.12.13", 30000)  # None on a host without a default route
    if routed:
        assert sa.sync_address(REMOTE, {"NCCL_SOCKET_IFNAME": "^lo"}) == routed


def test_loopback_is_refused_when_servers_are_elsewhere(monkeypatch):
    """No route (e.g. an unresolvable server name) and a host name mapped to 127.0.1.1 (Debian images): the
    servers on other hosts could not reach it, so the sync refuses and names the fix."""
    monkeypatch.setattr(sa, "route_source", lambda host, port: None)
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "127.0.1.1")
    with pytest.raises(EngineError, match=r"loopback address 127\.0\.1\.1.*set SRPO_SYNC_HOST"):
        sa.sync_address(REMOTE, {})
    assert sa.sync_address(["http://localhost:30000"], {}) == "127.0.1.1"  # same host: reachable


def test_h100_cluster_sets_an_exact_gloo_interface_in_the_job_env():
    """gloo (host-object groups, the sync address) needs its own interface setting: NCCL's ``^lo,...`` is
    not gloo syntax. The cluster file's value reaches the job's environment."""
    h100 = load_cluster(REPO / "cluster" / "h100.yaml")
    gloo = h100.env["GLOO_SOCKET_IFNAME"]
    assert gloo and not gloo.startswith(("^", "=")), "gloo takes exact interface names"
    assert h100.env["NCCL_SOCKET_IFNAME"]
    env, _ = _job_env(h100, LaunchRequest("srpo-x", srpo_train_command("r.yaml")))
    assert env["GLOO_SOCKET_IFNAME"] == gloo
