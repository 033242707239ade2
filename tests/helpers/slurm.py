"""The local-Slurm fixtures of the Slurm tier (``tools/dev test`` starts the cluster): both are autouse, so a
module that imports them skips without a cluster and runs every test with its own nemo-run home."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from srpo_megatron.launch import jobs


@pytest.fixture(scope="module", autouse=True)
def slurm_cluster():
    if not os.environ.get("SLURM_CONF"):
        pytest.skip("SLURM_CONF is unset: no local Slurm (tools/dev test starts one)")
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.fail(f"SLURM_CONF={os.environ['SLURM_CONF']} is set but sinfo failed: {e}")
    if (
        out.returncode != 0
        or not out.stdout.split()
        or out.stdout.split()[0] not in ("idle", "mixed", "allocated")
    ):
        pytest.fail(
            f"SLURM_CONF={os.environ['SLURM_CONF']} is set but the cluster is not answering "
            f"(sinfo rc={out.returncode}: {out.stdout.strip()} {out.stderr.strip()}); "
            "run tools/slurm_local.sh start"
        )


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    # nemo-run runs shell steps through `invoke`, which mirrors stdin; pytest's captured stdin raises.
    with open(os.devnull) as devnull:
        monkeypatch.setattr(sys, "stdin", devnull)
        yield jobs.set_home(tmp_path / "nemorun_home")
