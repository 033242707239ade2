"""`srpo launch --cluster cluster/local.yaml`: the workstation path (nemo-run LocalExecutor + torchrun)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import yaml

from srpo_megatron.launch import commands, jobs


def test_local_launch_runs_under_torchrun_and_jobs_shows_it(tmp_path, monkeypatch, capsys):
    with open(os.devnull) as devnull:  # nemo-run's `invoke` steps mirror stdin, which pytest captures
        monkeypatch.setattr(sys, "stdin", devnull)
        jobs.set_home(tmp_path / "home")
        run_dir = tmp_path / "run"
        recipe = tmp_path / "probe.yaml"
        tiny = Path(__file__).resolve().parents[2] / "examples" / "tiny_cpu_test.yaml"  # a whole recipe
        recipe.write_text(
            yaml.safe_dump({"base": str(tiny), "run": {"dir": str(run_dir)}, "train": {"steps": 2}})
        )
        assert (
            commands.main(["launch", str(recipe), "--cluster", "cluster/local.yaml", "--probe", "--wait"])
            == 0
        )
        capsys.readouterr()
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(line) for line in lines] == [
            {"step": 1, "world_size": 1},
            {"step": 2, "world_size": 1},
        ]
        assert commands.main(["jobs", "status"]) == 0
        assert "SUCCEEDED" in capsys.readouterr().out.split()
        assert commands.main(["jobs", "logs", "--tail", "2"]) == 0
        assert capsys.readouterr().out.splitlines() == [
            "[default0]:probe: step 2/2 done",
            "[default0]:probe: finished",
        ]
