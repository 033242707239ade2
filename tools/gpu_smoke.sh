#!/usr/bin/env bash
# One-GPU smoke check of the GPU path, against each tested megatron-core version. Ends with ONE JSON line.
#
# For a machine with one NVIDIA GPU and a stock PyTorch (no Transformer Engine, no SGLang, no apex).
# megatron-core and the project's other dependencies come from .whl/ (tools/prepare_gpu_wheels.sh, run
# where PyPI is reachable) when this interpreter lacks them: each megatron-core version is installed into
# its own target directory (.smoke/mcore-<v>) put first on PYTHONPATH; missing deps go to .smoke/deps.
# Per version:
#   tests      (a) tests/unit + tests/dist with run_distributed limited to world size 1 (NCCL cannot put
#                  two ranks on one GPU; multi-rank layouts stay CPU-tested)
#   train      (b) `srpo train` of examples/tiny_cpu_test.yaml on CUDA (transformers rollout engine,
#                  bf16, 3 steps): losses finite, weights moved (exported checkpoint vs the HF weights),
#                  trainer-vs-engine log-prob gap per step
#   bench_losses (c) tools/bench_losses.py --device cuda (first version only: the loss code is ours)
#   bench_mfu  (d) tools/bench_mfu.py: Qwen3-1.7B-shaped random model, local spec, bf16, seq 4096,
#                  recompute none and full: tokens/s and MFU against PEAK_TFLOPS
# Without a CUDA GPU it prints one line saying so and exits 0.
#
#   bash tools/gpu_smoke.sh        # env: PYTHON (python3), MCORE_VERSIONS ("0.16.1 0.19.2"),
#                                  #      PEAK_TFLOPS (790, measured H200 dense bf16), SMOKE_BUDGET_S (470)
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
MCORE_VERSIONS=${MCORE_VERSIONS:-"0.16.1 0.19.2"}
PEAK_TFLOPS=${PEAK_TFLOPS:-790}
BUDGET=${SMOKE_BUDGET_S:-470}  # whole run, so that it ends within 8 minutes
WORK=$ROOT/.smoke

if ! timeout 120 "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
  echo '{"gpu_smoke":"skipped","reason":"no CUDA GPU visible to torch; nothing was run"}'
  exit 0
fi

rm -rf "$WORK"
mkdir -p "$WORK/parts" "$WORK/logs"
START=$SECONDS

# part NAME VERSION TIMEOUT CMD...: run CMD with the remaining budget, keep its log, record one JSON part.
part() {
  local name=$1 version=$2 limit=$3
  shift 3
  local left=$((BUDGET - (SECONDS - START)))
  local log="$WORK/logs/${version}__${name}.log" out="$WORK/parts/${version}__${name}.json"
  if ((left < 15)); then
    echo '{"ok":false,"error":"not run: the 8-minute budget is spent"}' >"$out"
    return
  fi
  ((limit > left)) && limit=$left
  local t0=$SECONDS
  timeout "$limit" "$@" >"$log" 2>&1
  local rc=$?
  "$PY" "$ROOT/tools/gpu_smoke_checks.py" wrap "$log" "$rc" "$((SECONDS - t0))" >"$out"
}

DEPS_PATH=""
missing=$(PYTHONPATH=$ROOT "$PY" tools/gpu_smoke_checks.py missing-deps 2>/dev/null)
if [ -n "$missing" ]; then
  # shellcheck disable=SC2086  # one distribution name per word
  if "$PY" -m pip install -q --no-index --no-deps --find-links "$ROOT/.whl/deps" --target "$WORK/deps" $missing \
    >"$WORK/logs/deps.log" 2>&1; then
    DEPS_PATH=$WORK/deps
  else
    echo "{\"ok\":false,\"error\":\"missing $(echo $missing) and no wheels in .whl/deps: run tools/prepare_gpu_wheels.sh\"}" \
      >"$WORK/parts/setup__deps.json"
  fi
fi

first=1
for v in $MCORE_VERSIONS; do
  site=$WORK/mcore-$v
  if ! "$PY" -m pip install -q --no-index --no-deps --find-links "$ROOT/.whl/mcore-$v" --target "$site" \
    "megatron-core==$v" >"$WORK/logs/${v}__install.log" 2>&1; then
    echo "{\"ok\":false,\"error\":\"no megatron-core $v wheel in .whl/mcore-$v: run tools/prepare_gpu_wheels.sh\"}" \
      >"$WORK/parts/${v}__install.json"
    continue
  fi
  export PYTHONPATH=$ROOT:$site${DEPS_PATH:+:$DEPS_PATH}
  export SRPO_TEST_MAX_WORLD_SIZE=1
  "$PY" -c "import megatron.core as m, json; print(json.dumps({'ok': m.__version__ == '$v', 'version': m.__version__}))" \
    >"$WORK/parts/${v}__version.json" 2>"$WORK/logs/${v}__version.log"

  part tests "$v" 110 "$PY" -m pytest -q -p no:cacheprovider tests/unit tests/dist -m "not slurm and not slow" \
    --junitxml="$WORK/${v}__junit.xml" -W ignore::UserWarning -W ignore::DeprecationWarning
  "$PY" tools/gpu_smoke_checks.py junit "$WORK/${v}__junit.xml" "$WORK/parts/${v}__tests.json"

  tiny=$WORK/tiny
  [ -d "$tiny" ] || "$PY" tools/gpu_smoke_checks.py prepare-tiny "$tiny" >"$WORK/logs/tiny.log" 2>&1
  run=$WORK/train-$v
  part train_run "$v" 75 "$PY" -m srpo_megatron.cli train examples/tiny_cpu_test.yaml \
    -o "model.hf_dir=$tiny/qwen3" -o "data.train_files=[$tiny/train.jsonl]" -o "run.dir=$run" \
    -o model.params_dtype=bf16 -o train.steps=3 -o run.tensorboard=false -o run.save_every=0
  part train "$v" 60 "$PY" tools/gpu_smoke_checks.py train-report "$run" "$tiny/qwen3"

  if ((first)); then
    part bench_losses "$v" 40 "$PY" tools/bench_losses.py --device cuda
    first=0
  fi
  part bench_mfu "$v" 90 "$PY" tools/bench_mfu.py --peak-tflops "$PEAK_TFLOPS"
done

"$PY" tools/gpu_smoke_checks.py combine "$WORK"/parts/*.json "$((SECONDS - START))"
