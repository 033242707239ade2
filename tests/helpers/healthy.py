"""Healthy runs restart nothing: a run whose engines did not fault must not rebuild one.

The trainer recovers from a failed engine by restarting it alone and resyncing
(``trainer/collect/rollout_service.py``), and the run then ends rc 0; a restart that no fault caused (an
engine sent work while its memory was released, a sync order bug) would hide the same way. So every
``metrics.jsonl`` a test leaves behind is checked: its counters of recoveries (``RECOVERY_METRICS``) stay 0
on every row. ``tests/conftest.py`` checks every run under a test's ``tmp_path`` and every module fixture's
folder; ``read_metrics`` checks the run it reads. A test that faults an engine on purpose opts out with
``@pytest.mark.engine_faults``.
"""

from __future__ import annotations

import json
from pathlib import Path

# The trainer's counters of recoveries from engine faults (trainer/step_types.py METRICS).
RECOVERY_METRICS = ("engine/restarts",)
OPT_OUT = "(a test that faults an engine on purpose opts out: @pytest.mark.engine_faults)"


def recoveries(rows: list[dict], where: str) -> list[str]:
    """One line per row of ``rows`` (a run's metrics) that counts a recovery."""
    return [
        f"{where}: step {r.get('step')} has {k} = {r[k]} (an engine was restarted in a healthy run)"
        for r in rows
        for k in RECOVERY_METRICS
        if r.get(k, 0) != 0
    ]


def assert_no_recoveries(rows: list[dict], where: str) -> None:
    bad = recoveries(rows, where)
    assert not bad, "\n".join([*bad[:5], OPT_OUT])


def assert_healthy_runs(root: Path) -> None:
    """Every ``metrics.jsonl`` under ``root`` counts no recovery."""
    bad: list[str] = []
    for path in sorted(Path(root).rglob("metrics.jsonl")):
        try:
            rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        except (OSError, ValueError):
            continue  # a run killed mid-line (resume tests): what it wrote is the test's business
        bad += recoveries(rows, str(path))
    assert not bad, "\n".join([*bad[:5], OPT_OUT])
