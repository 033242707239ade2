"""The result of one doctor check, and how a list of them is printed and turned into an exit code."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Literal

Status = Literal["ok", "warn", "fail"]

# Said by every GPU-only package check on a machine without CUDA (where it is not needed).
NOT_INSTALLED_GPU_EXTRA = "not installed (GPU extra)"


@dataclass(frozen=True)
class Check:
    """One line of the report."""

    name: str  # what was checked, e.g. "torch" or "run.dir"
    status: Status  # ok: fine; warn: works but should be fixed; fail: the job would fail
    detail: str  # what was found (a version, a path, a count)
    fix: str = ""  # what to do about a warn/fail; empty when ok


def ok(name: str, detail: str) -> Check:
    return Check(name, "ok", detail)


def warn(name: str, detail: str, fix: str) -> Check:
    return Check(name, "warn", detail, fix)


def fail(name: str, detail: str, fix: str) -> Check:
    return Check(name, "fail", detail, fix)


def exit_code(checks: list[Check]) -> int:
    """1 when any check failed (the job would fail on this node), else 0; warnings do not fail."""
    return 1 if any(c.status == "fail" for c in checks) else 0


def render_text(checks: list[Check], where: str) -> str:
    """One line per check, ``STATUS  NAME  DETAIL  -> FIX``, and a summary line.

    The status word is upper-case for warn/fail so that ``grep FAIL`` finds them in a job log.
    """
    width = max((len(c.name) for c in checks), default=0)
    lines = [f"srpo doctor on {where}"]
    for c in checks:
        word = c.status if c.status == "ok" else c.status.upper()
        line = f"  {word:<4}  {c.name:<{width}}  {c.detail}"
        if c.fix:
            line += f"  -> {c.fix}"
        lines.append(line)
    failed = [c.name for c in checks if c.status == "fail"]
    warned = [c.name for c in checks if c.status == "warn"]
    if failed:
        lines.append(f"srpo doctor: FAILED on {where}: {', '.join(failed)}")
    else:
        lines.append(f"srpo doctor: passed on {where}" + (f" ({len(warned)} warning(s))" if warned else ""))
    return "\n".join(lines)


def render_json(checks: list[Check], where: str) -> str:
    return json.dumps(
        {"host": where, "passed": exit_code(checks) == 0, "checks": [asdict(c) for c in checks]}, indent=2
    )
