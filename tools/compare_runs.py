"""Compare two runs' per-step metrics and evaluations bit for bit, wall-clock figures left out.

    python tools/compare_runs.py RUN_DIR_A RUN_DIR_B

Reads ``metrics.jsonl`` and ``eval_log.jsonl`` of each run directory (``srpo train`` writes both) and
compares every value exactly (``==`` on the parsed JSON floats), except the keys that measure time
(``time/*``, ``perf/*``, ``rollout/engine_seconds_max``, ``rollout/sync_s``, an evaluation's
``elapsed_s``). Used to show a refactor changes no number: e.g. the CPU demo (``tools/dev demo
run.dir=A``) at two commits. Prints the first differences and ends with ONE JSON line; exits 1 when the
runs differ.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

WALL_CLOCK = (
    "time/",
    "perf/",
    "rollout/engine_seconds_max",
    "rollout/sync_s",
    "elapsed_s",
    "async/engine_idle_share",
    "async/trainer_idle_share",
)


def _rows(run: Path, name: str) -> list[dict]:
    path = run / name
    if not path.is_file():
        raise SystemExit(f"{path}: not found; pass a run directory that `srpo train` wrote (run.dir)")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{k: v for k, v in r.items() if not k.startswith(WALL_CLOCK)} for r in rows]


def _differences(a: list[dict], b: list[dict], what: str, added: set[str] | None = None) -> list[str]:
    """Every value that differs; with ``added`` (a set to fill), keys only B has are collected there
    instead (B was written by a newer version that logs more)."""
    if len(a) != len(b):
        return [f"{what}: {len(a)} rows vs {len(b)}"]
    out = []
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if added is not None:
            added.update(set(y) - set(x))
        for key in sorted(set(x) | (set(y) if added is None else set())):
            if x.get(key) != y.get(key):
                out.append(f"{what} row {i} (step {x.get('step')}): {key} = {x.get(key)!r} vs {y.get(key)!r}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("a", type=Path, help="run directory")
    parser.add_argument("b", type=Path, help="run directory")
    parser.add_argument(
        "--new-keys-ok",
        action="store_true",
        help="keys only B logs (a newer version's metrics) are listed, not counted as differences",
    )
    args = parser.parse_args()
    metrics_a, metrics_b = _rows(args.a, "metrics.jsonl"), _rows(args.b, "metrics.jsonl")
    added: set[str] | None = set() if args.new_keys_ok else None
    diffs = _differences(metrics_a, metrics_b, "metrics.jsonl", added)
    diffs += _differences(_rows(args.a, "eval_log.jsonl"), _rows(args.b, "eval_log.jsonl"), "eval_log.jsonl")
    for line in diffs[:20]:
        print(line)
    values = sum(len(r) for r in metrics_a)
    summary = {"steps": len(metrics_a), "values_compared": values, "differences": len(diffs)}
    if added is not None:
        summary["keys_only_in_b"] = sorted(added)
    print(json.dumps({**summary, "identical": not diffs}))
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
