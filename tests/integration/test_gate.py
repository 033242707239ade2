"""The training-metric gate (``tools/dev gate``, ``srpo_megatron.testing.gate``) on this checkout: the
gated CPU run (70-160 s: 160 s measured at load 12 on 2 cores) lies within its bands around
``tests/gate/history.json``.

The planted regressions (``srpo_megatron.testing.gate_plants``: entropy weights off, TIS cap changed, EMA α
changed, routing all-wrong groups to SDPO) each cost one more gated run, so they are marked ``slow``
(``SRPO_SLOW=1 tools/dev test tests/integration/test_gate.py`` runs them): each must FAIL the gate and name
what moved."""

from __future__ import annotations

import subprocess
import sys

import pytest

from srpo_megatron.testing import gate
from srpo_megatron.testing.gate_plants import PLANTS


def _gate(tmp_path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "srpo_megatron.testing.gate", "--out", str(tmp_path / "gate"), *args]
    return subprocess.run(cmd, cwd=gate.REPO, capture_output=True, text=True, timeout=900)


def test_the_gate_passes_on_this_checkout(tmp_path):
    proc = _gate(tmp_path)
    assert proc.returncode == 0, (
        "the training metrics moved outside their bands (tests/gate/). If the change is intended, run "
        f"`tools/dev gate --update` and commit the reviewed history diff:\n{proc.stdout[-6000:]}"
        f"\n{proc.stderr[-2000:]}"
    )
    assert "[gate] PASS" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("plant", PLANTS)
def test_the_gate_fails_on_a_planted_regression(tmp_path, plant):
    proc = _gate(tmp_path, "--plant", plant)
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "[gate] FAIL" in proc.stdout and "metric" in proc.stdout and "band" in proc.stdout
    assert list((tmp_path / "gate" / "moved").glob("*.png")), "a PNG per moved curve"
