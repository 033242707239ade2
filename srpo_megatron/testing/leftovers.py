"""``tools/dev test`` ends by checking that no process it started outlived it.

``tools/dev test`` exports ``SRPO_TEST_RUN=<id>`` before the first pytest; every process of the run
inherits it (forked, spawned or exec'd children alike, also once reparented to init). Afterwards
``python -m srpo_megatron.testing.leftovers <id>`` lists the processes whose environment still carries
that id (read from ``/proc/PID/environ``), waits a grace period for those just exiting, prints each
remaining one with its pid, parent and command line, kills them and exits 1. Processes that exec'd with
an environment of their own (``env=`` without the variable) are not seen: the check can only miss a
leftover, never accuse a process outside the run. Slurm job steps of the local cluster (under a
``slurmstepd``) are left to the cluster's own stop, which follows.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path

MARKER = "SRPO_TEST_RUN"


def _environ_has(pid: int, entry: bytes) -> bool:
    try:
        return entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:  # gone, a zombie, or not ours to read
        return False


def _stat(pid: int) -> tuple[str, str, int] | None:
    """``(comm, state, parent pid)`` from ``/proc/PID/stat``."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    comm, rest = stat.split("(", 1)[1].rsplit(")", 1)
    fields = rest.split()
    return comm, fields[0], int(fields[1])


def _under_slurmstepd(pid: int) -> bool:
    seen = 0
    while pid > 1 and seen < 64:
        info = _stat(pid)
        if info is None:
            return False
        if info[0] == "slurmstepd":
            return True
        pid, seen = info[2], seen + 1
    return False


def _describe(pid: int) -> str | None:
    info = _stat(pid)
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None
    if info is None or info[1] == "Z":  # a zombie holds nothing: its parent has yet to reap it
        return None
    return f"pid {pid} (parent {info[2]}): {cmd[:300] or '[' + info[0] + ']'}"


def leftovers(run_id: str, exclude: set[int] | None = None) -> dict[int, str]:
    """``{pid: description}`` of the live processes carrying ``SRPO_TEST_RUN=run_id``."""
    entry = f"{MARKER}={run_id}".encode()
    skip = {os.getpid(), *(exclude or set())}
    found = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) not in skip and _environ_has(int(d.name), entry):
            text = _describe(int(d.name))
            if text is not None and not _under_slurmstepd(int(d.name)):
                found[int(d.name)] = text
    return found


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not args[0]:
        print(f"usage: python -m srpo_megatron.testing.leftovers RUN_ID ({MARKER}'s value)", file=sys.stderr)
        return 2
    run_id, grace_s = args[0], float(os.environ.get("SRPO_LEFTOVER_GRACE_S", "20"))
    deadline = time.monotonic() + grace_s
    found = leftovers(run_id)
    while found and time.monotonic() < deadline:  # children of a just-finished test may still be exiting
        time.sleep(1.0)
        found = leftovers(run_id)
    if not found:
        print(f"[dev] no process of this test run ({MARKER}={run_id}) outlived it")
        return 0
    print(f"[dev] FAIL: {len(found)} process(es) of this test run outlived it (killed now):", file=sys.stderr)
    for pid, text in sorted(found.items()):
        print(f"[dev]   {text}", file=sys.stderr)
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return 1


if __name__ == "__main__":
    sys.exit(main())
