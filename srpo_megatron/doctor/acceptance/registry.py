"""The acceptance checks' registry: each check's name, what it proves, its fix, and how it runs.

A check is a function ``run(ctx) -> Outcome``. It returns :func:`passed` or :func:`failed` with what it
measured; :func:`skipped` when this machine cannot run it (no CUDA, a part not installed). The
registry adds the check's name, what it proves and the fix (said with every failure) and the seconds.
Probes (:class:`Probes`) are how a check asks the machine about itself (CUDA, cuDNN, package versions):
tests replace them to plant a fault without the fault's hardware.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

Status = Literal["ok", "warn", "skipped", "fail"]
NEEDS_CUDA = "needs CUDA"


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _cudnn_version() -> int | None:
    """``torch.backends.cudnn.version()``: e.g. 91301 for 9.13.1; None on a build without cuDNN."""
    import torch

    return torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None


def _cuda_runtime() -> str | None:
    import torch

    return torch.version.cuda


def _dist_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent package that fails to import, or a broken spec
        return False


@dataclass
class Probes:
    """How checks see this machine; replace one to plant a fault (tests)."""

    cuda_available: Callable[[], bool] = _cuda_available
    cudnn_version: Callable[[], int | None] = _cudnn_version
    cuda_runtime: Callable[[], str | None] = _cuda_runtime
    dist_version: Callable[[str], str | None] = _dist_version
    has_module: Callable[[str], bool] = _has_module


@dataclass
class Context:
    """What every check gets: the probes, the recipe of the train check, a scratch folder, a time limit."""

    probes: Probes
    recipe: str  # "" = the tiny recipe
    work_dir: Path
    timeout_s: float = 300.0  # one check's subprocess(es) together
    overrides: tuple[str, ...] = ()  # --override KEY=VALUE items for the recipe's train run
    cache: dict[str, Any] = field(default_factory=dict)  # a child run shared by several checks


@dataclass(frozen=True)
class Outcome:
    status: Status
    detail: str
    metrics: dict[str, Any] = field(default_factory=dict)


def passed(detail: str, **metrics: Any) -> Outcome:
    return Outcome("ok", detail, metrics)


def warned(detail: str, **metrics: Any) -> Outcome:
    return Outcome("warn", detail, metrics)


def failed(detail: str, **metrics: Any) -> Outcome:
    return Outcome("fail", detail, metrics)


def skipped(reason: str) -> Outcome:
    return Outcome("skipped", reason)


def needs_cuda(why: str) -> Outcome:
    return skipped(f"{NEEDS_CUDA}: {why}")


@dataclass(frozen=True)
class AcceptanceCheck:
    name: str  # e.g. "te_attention.gpt_oss.thd"
    proves: str  # what an ok result shows about this node
    fix: str  # what to do when it fails
    run: Callable[[Context], Outcome]


@dataclass(frozen=True)
class Result:
    """One check's line of the report."""

    check: str
    status: Status
    detail: str
    proves: str
    fix: str
    seconds: float
    metrics: dict[str, Any]

    def json_line(self) -> str:
        row = {"check": self.check, "status": self.status, "detail": self.detail, "proves": self.proves}
        if self.status in ("fail", "warn"):
            row["fix"] = self.fix
        if self.metrics:
            row["metrics"] = self.metrics
        row["seconds"] = round(self.seconds, 2)
        return json.dumps(row, default=str)


def run_check(check: AcceptanceCheck, ctx: Context) -> Result:
    """Run one check; an exception is that check's failure (with its last lines), never the report's end."""
    start = time.monotonic()
    try:
        out = check.run(ctx)
    except Exception as e:
        tail = traceback.format_exc().strip().splitlines()[-3:]
        out = failed(f"raised {type(e).__name__}: {e} ({' | '.join(t.strip() for t in tail)})")
    return Result(
        check.name, out.status, out.detail, check.proves, check.fix, time.monotonic() - start, out.metrics
    )


def summary_line(results: list[Result], seconds: float) -> str:
    failed_names = [r.check for r in results if r.status == "fail"]
    counts = {s: sum(r.status == s for r in results) for s in ("ok", "warn", "skipped", "fail")}
    return json.dumps(
        {"summary": "srpo doctor --acceptance", "passed": not failed_names, **counts, "failed": failed_names,
         "seconds": round(seconds, 1)}
    )  # fmt: skip


def exit_code(results: list[Result]) -> int:
    """1 when a check failed; ok, warn and skipped pass."""
    return 1 if any(r.status == "fail" for r in results) else 0
