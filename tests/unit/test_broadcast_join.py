"""Creating a stage's weight-sync group (``StageBroadcaster``) when a server fails to join it.

The stand-in transports answer ``init_weights_update_group`` as SGLang does (``{"success": false,
"message": ...}``) without any server behind them, so the real rendezvous on our side (a TCP store and a
gloo group) waits for a peer that never comes. The sender must report the server's error as soon as the
server gave it, not after ``timeout_s``: the tests give an hour and wait 60 s for the error, so the old
behaviour (wait out the rendezvous, then report) fails them.
"""

from __future__ import annotations

import re
import threading
import time

from srpo_megatron.rollout.base import EngineError
from srpo_megatron.weights.broadcast_sync import StageBroadcaster

AN_HOUR = 3600.0  # the sender's timeout_s
WITHIN_S = 60.0  # how long a test waits for the sender's error
REFUSAL = {"success": False, "message": "Failed to init process group: NCCL error: unhandled system error"}


class Refuses:
    """A server whose join fails at once (e.g. its NCCL init failed)."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def call(self, method: str, body: dict | None = None, http_method: str = "POST"):
        self.calls.append(method)
        return REFUSAL if method == "init_weights_update_group" else {"success": True}


class Waits:
    """A healthy server: its join blocks in its side of the rendezvous (until the test releases it)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def call(self, method: str, body: dict | None = None, http_method: str = "POST"):
        self.release.wait()
        return {"success": False, "message": "the group never formed"}


class RefusesAfterOurTimeout:
    """A server that reports its own failure only after our side of the rendezvous (timeout_s=1) gave up.

    Should our timeout come later on a loaded machine, the server's error still arrives first: either
    way it is the one the sender must report, not the rendezvous' timeout."""

    def call(self, method: str, body: dict | None = None, http_method: str = "POST"):
        time.sleep(3.0)
        return REFUSAL


def _broadcaster(transports: list, urls: list[str], timeout_s: float = AN_HOUR) -> StageBroadcaster:
    tp = [1] * len(transports)
    return StageBroadcaster(
        transports, urls, tp, "srpo-test-pp0-g0", "gloo", "127.0.0.1", timeout_s=timeout_s
    )


def _error_of(transports: list, urls: list[str], **kwargs) -> EngineError:
    """The EngineError creating the group raises, which must come within ``WITHIN_S`` although the sender
    was given an hour. The sender runs in a thread, so a sender still stuck in the rendezvous (a C call
    that no signal interrupts) fails the test instead of hanging it."""
    out: list[BaseException | None] = []

    def create() -> None:
        try:
            _broadcaster(transports, urls, **kwargs)
            out.append(None)
        except BaseException as e:
            out.append(e)

    sender = threading.Thread(target=create, daemon=True)
    sender.start()
    sender.join(WITHIN_S)
    assert out, (
        f"the sender still waits in the rendezvous after {WITHIN_S:.0f} s (timeout_s={AN_HOUR:.0f}): a "
        "server that answered its join with an error must end the wait"
    )
    assert isinstance(out[0], EngineError), out[0]
    return out[0]


def test_a_server_that_fails_to_join_is_named_without_waiting_for_the_timeout():
    server = Refuses()
    err = str(_error_of([server], ["http://10.0.0.9:30000"]))
    assert "init_weights_update_group failed on http://10.0.0.9:30000" in err
    assert "NCCL error: unhandled system error" in err
    assert server.calls == ["init_weights_update_group"]


def test_the_failed_server_ends_the_wait_while_the_others_still_wait_in_the_rendezvous():
    healthy, broken = Waits(), Refuses()
    try:
        err = str(_error_of([healthy, broken], ["http://a:30000", "http://b:30000"]))
        assert "failed on http://b:30000" in err and "http://a:30000" not in err
    finally:
        healthy.release.set()


def test_after_our_timeout_the_servers_own_error_is_the_one_reported():
    late = [RefusesAfterOurTimeout()]
    err = _error_of(late, ["http://c:30000"], timeout_s=1.0)
    assert re.search(r"failed on http://c:30000: .*NCCL error", str(err)), err
