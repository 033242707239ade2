"""The suite's rule for healthy runs (``tests/helpers/healthy.py``): a ``metrics.jsonl`` that counts an
engine restart fails the check, one that does not passes, and ``read_metrics`` applies it unless told the
run faulted an engine on purpose."""

from __future__ import annotations

import json

import pytest

from tests.helpers.healthy import assert_healthy_runs
from tests.helpers.train import read_metrics


def _run(path, restarts):
    path.mkdir(parents=True)
    rows = [{"step": 1, "engine/restarts": 0.0}, {"step": 2, "engine/restarts": restarts}]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_run_that_restarted_an_engine_is_not_healthy(tmp_path):
    _run(tmp_path / "a" / "run", 0.0)
    assert_healthy_runs(tmp_path)
    assert [r["step"] for r in read_metrics(tmp_path / "a" / "run")] == [1, 2]
    _run(tmp_path / "b" / "deep" / "run", 1.0)
    with pytest.raises(AssertionError, match=r"step 2 has engine/restarts = 1\.0"):
        assert_healthy_runs(tmp_path)
    with pytest.raises(AssertionError, match="engine_faults"):
        read_metrics(tmp_path / "b" / "deep" / "run")
    assert len(read_metrics(tmp_path / "b" / "deep" / "run", engine_faults=True)) == 2
    (tmp_path / "b" / "deep" / "run" / "metrics.jsonl").unlink()  # the conftest check would see it too
