"""Benchmark: wall-clock start-up of the login-node commands against importing torch, in one run.

Times, each in a fresh interpreter (``--repeat`` times, the median is reported):

- ``srpo plan examples/qwen3_8b_srpo.yaml --cluster h100 --nodes 4`` (the memory plan, a table);
- ``srpo launch examples/tiny_cpu_test.yaml --cluster local --dryrun`` (nemo-run's local experiment);
- ``srpo launch examples/qwen3_8b_srpo.yaml --cluster h100 --nodes 4 --dryrun`` (the sbatch script);
- ``python -c "import srpo_megatron.config"`` (the typed recipe);
- ``python -c "import torch"``, what every command paid before the recipe became torch-free.

Each command's run records the modules it imported (an ``atexit`` hook), so the output also says
whether torch was loaded. The figures depend on the machine and its load; the ratios to ``import torch``
measured in the same run are what carries over, and so does the CPU time (user + system of the child),
which a loaded machine stretches less than the wall clock. Last line printed: one JSON object.

    python tools/bench_cli_startup.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# `python -c` program: run the CLI as `python -m srpo_megatron.cli ARGS`, then write the imported modules.
WRAPPER = (
    "import atexit, json, runpy, sys\n"
    "out = sys.argv.pop(1)\n"
    "atexit.register(lambda: open(out, 'w').write(json.dumps(sorted(sys.modules))))\n"
    "sys.argv[0] = 'srpo'\n"
    "runpy.run_module('srpo_megatron.cli', run_name='__main__', alter_sys=True)\n"
)


def _cpu_children() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _run(argv: list[str], modules: Path | None) -> tuple[float, float, bool]:
    """(wall seconds, CPU seconds, torch imported) of one fresh-interpreter run; raises if it fails."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    t0, c0 = time.perf_counter(), _cpu_children()
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    seconds, cpu = time.perf_counter() - t0, _cpu_children() - c0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    torch = "torch" in json.loads(modules.read_text()) if modules is not None else True
    return seconds, cpu, torch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="runs per command (median reported)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        home, modules = Path(tmp) / "nemo_run", Path(tmp) / "modules.json"
        cli = [sys.executable, "-c", WRAPPER, str(modules)]
        dryrun = ["--dryrun", "--home", str(home)]
        qwen = ["examples/qwen3_8b_srpo.yaml", "--cluster", "h100", "--nodes", "4"]
        tiny = ["examples/tiny_cpu_test.yaml", "--cluster", "local"]
        commands = {
            "plan": [*cli, "plan", *qwen],
            "launch_dryrun_local": [*cli, "launch", *tiny, *dryrun],
            "launch_dryrun_slurm": [*cli, "launch", *qwen, *dryrun],
            "import_config": [sys.executable, "-c", "import srpo_megatron.config"],
            "import_torch": [sys.executable, "-c", "import torch"],
        }
        wall: dict[str, list[float]] = {name: [] for name in commands}
        cpu: dict[str, list[float]] = {name: [] for name in commands}
        torch_loaded: dict[str, bool] = {}
        for _ in range(args.repeat):  # interleaved, so a load spike hits every command alike
            for name, argv in commands.items():
                wrapped = argv[:3] == cli[:3]
                seconds, cpu_s, torch = _run(argv, modules if wrapped else None)
                wall[name].append(seconds)
                cpu[name].append(cpu_s)
                if wrapped:
                    torch_loaded[name] = torch
    median = {name: statistics.median(ts) for name, ts in wall.items()}
    median_cpu = {name: statistics.median(ts) for name, ts in cpu.items()}
    torch_s = median["import_torch"]
    for name, s in median.items():
        extra = f", torch imported: {torch_loaded[name]}" if name in torch_loaded else ""
        print(
            f"{name:22s} {s:6.2f} s wall, {median_cpu[name]:6.2f} s CPU "
            f"({s / torch_s:5.2f} x import torch{extra})"
        )
    result = {
        "median_s": {k: round(v, 3) for k, v in median.items()},
        "median_cpu_s": {k: round(v, 3) for k, v in median_cpu.items()},
        "ratio_to_import_torch": {k: round(v / torch_s, 3) for k, v in median.items() if k != "import_torch"},
        "torch_imported": torch_loaded,
        "repeat": args.repeat,
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "cpus": os.cpu_count(),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
