#!/usr/bin/env bash
# One-GPU smoke check of the GPU path. Ends within 8 minutes with ONE JSON line.
#
# For a machine with one NVIDIA GPU and a stock PyTorch (no Transformer Engine, no SGLang, no apex, no
# nemo-run, no network). megatron-core and the project's other dependencies come from .whl/
# (tools/prepare_gpu_wheels.sh, run where PyPI is reachable) when this interpreter lacks them: megatron-core
# goes into .cache/smoke/mcore-<v>, put first on PYTHONPATH; missing deps go to .cache/smoke/deps.
# The plan (tools/gpu_smoke_checks.py: part order and caps, summing within the budget):
#   setup/deps     missing dependencies from .whl/deps
#   <v>/install    megatron-core <v>; the container's version (0.19.2) runs first
#   <v>/tests      GPU_TESTS of gpu_smoke_checks.py: the tests whose code runs on CUDA, one rank each
#                  (run_distributed on CUDA: NCCL for CUDA tensors, gloo for host objects)
#   <v>/train_run  `srpo train` of examples/tiny_cpu_test.yaml on CUDA (transformers rollout engine, bf16,
#   <v>/train      3 steps, fusions off): losses finite, weights moved, trainer-vs-engine log-prob gap
#   <v>/compile    megatron's jit-fused SwiGLU through torch.compile on CUDA (first version of a call only,
#                  as are the benches): does this image compile it (triton, a C compiler), in how long
#   <v>/bench_losses  tools/bench_losses.py --device cuda
#   <v>/bench_fused_output  tools/bench_fused_output.py --cuda: megatron's output layer vs the fused one
#                  (bf16, T 8k, V 152k, H 4096), its bf16 weight-gradient GEMM vs the fp32 one
#   <v>/bench_mfu  tools/bench_mfu.py: Qwen3-1.7B-shaped random model, local spec, bf16, seq 4096,
#                  recompute none and full: tokens/s and MFU against PEAK_TFLOPS
# A version that does not fit the budget whole is not started; its parts say how to run it alone.
# torch.compile: the tests run with TORCH_COMPILE_DISABLE=1 and the train run with performance.fusions=off
# (a fresh interpreter per test would otherwise compile megatron's jit fusions each time); the compile part
# checks the compiled fusion once; bench_mfu keeps the fusions and compiles them in its untimed warm-up
# steps (eager, and "torch_compile": false in its part, when the compile part failed).
# Without a CUDA GPU it prints one line saying so and exits 0.
#
#   bash tools/gpu_smoke.sh            # env: PYTHON (python3), MCORE_VERSIONS ("0.19.2"; e.g. "0.16.1"
#                                      #      in a second call), PEAK_TFLOPS (790, measured H200 dense
#                                      #      bf16), SMOKE_BUDGET_S (460), SMOKE_DIR (.cache/smoke)
#   ACCEPTANCE=1 bash tools/gpu_smoke.sh   # inside the built image (TE, apex, SGLang, torch_memory_saver):
#                                      # `srpo doctor --acceptance --json` instead of this plan (<= 10 min);
#                                      # its check lines in SMOKE_DIR/acceptance.jsonl, its summary as the
#                                      # one line, its exit status (on a CPU it runs what can run, rc 0)
#   SMOKE_REHEARSE=1 bash tools/gpu_smoke.sh   # the same plan on this CPU machine: tests, train and report
#                                      # run for real, the benches at CPU sizes, megatron-core as installed
#                                      # (SMOKE_DIR .cache/smoke-rehearsal); the JSON: each part's seconds
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
START=$SECONDS
PY=${PYTHON:-python3}
REHEARSE=${SMOKE_REHEARSE:-0}

if [ "${ACCEPTANCE:-0}" = 1 ]; then  # the image's parts: the acceptance check covers them, not this plan
  WORK=${SMOKE_DIR:-$ROOT/.cache/acceptance}
  mkdir -p "$WORK"
  PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH} "$PY" -m srpo_megatron.cli doctor --acceptance --json \
    >"$WORK/acceptance.jsonl" 2>"$WORK/acceptance.log"
  rc=$?
  last=$(tail -n 1 "$WORK/acceptance.jsonl")
  case $last in
    *'"summary"'*) echo "$last" ;;
    *) echo "{\"ok\":false,\"error\":\"srpo doctor --acceptance exited $rc without its summary; see $WORK\"}" ;;
  esac
  exit "$rc"
fi

MCORE_VERSIONS=${MCORE_VERSIONS:-0.19.2}
PEAK_TFLOPS=${PEAK_TFLOPS:-790}
BUDGET=${SMOKE_BUDGET_S:-460}  # the parts' share of the 8 minutes; the rest is start-up and the last line
CHECKS=$ROOT/tools/gpu_smoke_checks.py

if [ "$REHEARSE" = 1 ]; then
  MODE=rehearsal
  WORK=${SMOKE_DIR:-$ROOT/.cache/smoke-rehearsal}  # .cache/ is gitignored
  export SRPO_DIST_START_METHOD=spawn  # a fresh interpreter per rank, as on CUDA (run_distributed)
else
  MODE=ran
  WORK=${SMOKE_DIR:-$ROOT/.cache/smoke}
  if ! timeout 60 "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' \
    >/dev/null 2>&1; then
    echo '{"gpu_smoke":"skipped","reason":"no CUDA GPU visible to torch; nothing was run"}'
    exit 0
  fi
fi

rm -rf "$WORK"
mkdir -p "$WORK/parts" "$WORK/logs"
BASE_PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}
export PYTHONPATH=$BASE_PYTHONPATH

# part VERSION NAME CAP CMD...: run CMD within CAP and the budget left, keep its log, record one JSON part.
# SIGINT first (pytest then writes its junit file, run_distributed kills its ranks), SIGKILL 5 s later.
part() {
  local version=$1 name=$2 cap=$3
  shift 3
  local left=$((BUDGET - (SECONDS - START)))
  local log="$WORK/logs/${version}__${name}.log" out="$WORK/parts/${version}__${name}.json"
  if ((left < 10)); then
    echo "{\"ok\":false,\"error\":\"not run: the ${BUDGET} s budget is spent (earlier parts ran long)\"}" \
      >"$out"
    return
  fi
  local limit=$cap
  ((limit > left)) && limit=$left
  local t0=$SECONDS
  timeout -s INT -k 5 "$limit" "$@" >"$log" 2>&1
  local rc=$?
  "$PY" "$CHECKS" wrap "$log" "$rc" "$((SECONDS - t0))" "$cap" >"$out"
}

DEPS_PATH=""
run_part() {  # VERSION NAME CAP
  local v=$1 name=$2 cap=$3
  local tiny=$WORK/tiny run=$WORK/train-$v
  case $name in
    deps)
      part "$v" deps "$cap" "$PY" "$CHECKS" install-deps "$ROOT/.whl/deps" "$WORK/deps"
      [ -d "$WORK/deps" ] && DEPS_PATH=$WORK/deps
      ;;
    install)
      if [ "$MODE" = rehearsal ]; then  # cp312 wheels do not install here: check the interpreter's own
        export PYTHONPATH=$BASE_PYTHONPATH
        part "$v" install "$cap" "$PY" "$CHECKS" mcore-version "$v"
      else
        export PYTHONPATH=$BASE_PYTHONPATH${DEPS_PATH:+:$DEPS_PATH}
        part "$v" install "$cap" "$PY" "$CHECKS" install-mcore "$v" "$ROOT/.whl/mcore-$v" "$WORK/mcore-$v"
        export PYTHONPATH=$ROOT:$WORK/mcore-$v${DEPS_PATH:+:$DEPS_PATH}
      fi
      ;;
    tests)
      local ids
      mapfile -t ids < <("$PY" "$CHECKS" test-ids "$v" 2>>"$WORK/logs/${v}__test-ids.log")
      # One rank per test: NCCL cannot put two ranks on one GPU (run_distributed skips larger worlds).
      SRPO_TEST_MAX_WORLD_SIZE=1 TORCH_COMPILE_DISABLE=1 part "$v" tests "$cap" \
        "$PY" -m pytest -v -rfE -p no:cacheprovider --timeout 90 --junitxml="$WORK/${v}__junit.xml" \
        -W ignore::UserWarning -W ignore::DeprecationWarning "${ids[@]}"
      "$PY" "$CHECKS" junit "$WORK/${v}__junit.xml" "$WORK/parts/${v}__tests.json" \
        "$WORK/logs/${v}__tests.log"
      ;;
    train_run)
      [ -d "$tiny" ] || "$PY" "$CHECKS" prepare-tiny "$tiny" >"$WORK/logs/tiny.log" 2>&1
      # "off" quoted: the override is read as YAML, where a bare off is false.
      part "$v" train_run "$cap" "$PY" -m srpo_megatron.cli train examples/tiny_cpu_test.yaml \
        -o "model.hf_dir=$tiny/qwen3" -o "data.train_files=[$tiny/train.jsonl]" -o "run.dir=$run" \
        -o model.params_dtype=bf16 -o 'performance.fusions="off"' -o train.steps=3 -o run.tensorboard=false \
        -o run.save_every=0
      ;;
    train)
      part "$v" train "$cap" "$PY" "$CHECKS" train-report "$run" "$tiny/qwen3"
      ;;
    compile)
      if [ "$MODE" = rehearsal ]; then  # stubbed: inductor on a CPU builds C++, not the GPU's kernels
        TORCH_COMPILE_DISABLE=1 part "$v" compile "$cap" "$PY" "$CHECKS" compile-check
      else
        part "$v" compile "$cap" "$PY" "$CHECKS" compile-check
      fi
      ;;
    bench_losses)
      if [ "$MODE" = rehearsal ]; then
        part "$v" bench_losses "$cap" \
          "$PY" tools/bench_losses.py --device cpu --tokens 256 --vocab 4096 --k 16
      else
        part "$v" bench_losses "$cap" "$PY" tools/bench_losses.py --device cuda
      fi
      ;;
    bench_fused_output)
      if [ "$MODE" = rehearsal ]; then  # no CUDA here: the bench's "skipped: needs CUDA" line
        part "$v" bench_fused_output "$cap" "$PY" tools/bench_fused_output.py --cuda --quick
      else
        part "$v" bench_fused_output "$cap" "$PY" tools/bench_fused_output.py --cuda
      fi
      ;;
    bench_mfu)
      # The fusions compile in the warm-up steps; eager when the compile part failed, so MFU still comes.
      local compiled=true
      grep -q '"ok": true' "$WORK/parts/${v}__compile.json" 2>/dev/null || compiled=false
      [ "$compiled" = true ] || local -x TORCH_COMPILE_DISABLE=1  # this part only
      if [ "$MODE" = rehearsal ]; then
        part "$v" bench_mfu "$cap" \
          "$PY" tools/bench_mfu.py --shape tiny --seq 64 --steps 2 --warmup 1 --peak-tflops 1
      else
        part "$v" bench_mfu "$cap" "$PY" tools/bench_mfu.py --peak-tflops "$PEAK_TFLOPS" --steps 5 --warmup 2
      fi
      "$PY" "$CHECKS" annotate "$WORK/parts/${v}__bench_mfu.json" "torch_compile=$compiled"
      ;;
    *)
      echo "{\"ok\":false,\"error\":\"the plan names an unknown part $name\"}" \
        >"$WORK/parts/${v}__${name}.json"
      ;;
  esac
}

# shellcheck disable=SC2086  # one version per word
if ! "$PY" "$CHECKS" plan "$WORK/parts" "$BUDGET" $MCORE_VERSIONS \
  >"$WORK/plan.txt" 2>"$WORK/logs/plan.log"; then
  echo "{\"ok\":false,\"error\":\"no plan: $(tail -n 1 "$WORK/logs/plan.log" | tr -d '"\\')\"}" \
    >"$WORK/parts/setup__plan.json"
fi
while read -r v name cap <&3; do  # fd 3: a part that reads stdin must not eat the plan
  run_part "$v" "$name" "$cap" </dev/null
done 3<"$WORK/plan.txt"

PYTHONPATH=$BASE_PYTHONPATH \
  "$PY" "$CHECKS" combine "$MODE" "$BUDGET" "$((SECONDS - START))" "$WORK"/parts/*.json
