#!/usr/bin/env bash
# Everything that needs a GPU, in one run (< 10 minutes on one H200). Results go under $OUT
# (default bench/out/gpu). Run from the repository root on the GPU machine:
#   OUT=/some/dir bash bench/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/out/gpu}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0
{
  date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python -c 'import jax; print("jax", jax.__version__, jax.devices())'
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

echo "== 1. kernel tests, interpret off (numerics vs the reference on device)"
timeout 240 python -m pytest -q -p no:cacheprovider tests/test_kernels.py --junitxml="$OUT/kernel_tests.xml" \
  > "$OUT/kernel_tests.txt" 2>&1 || status=1
tail -3 "$OUT/kernel_tests.txt"

echo "== 2. kernel roofline: decode bandwidth, ragged FLOP/s, copy ceiling"
timeout 180 python bench/kernels.py --out "$OUT/kernels.json" --with-reference > "$OUT/kernels.txt" 2>&1 || status=1
tail -15 "$OUT/kernels.txt"

echo "== 3+4. end to end on a random-weight Llama-3-8B-shaped bf16 model; planner vs measured"
timeout 300 python bench/e2e_gpu.py --out "$OUT/e2e.json" > "$OUT/e2e.txt" 2>&1 || status=1
tail -12 "$OUT/e2e.txt"
echo "== 5. the same GPU build compiled deviceless for an H200 (as CI does on the CPU machine), to set beside 3+4"
JAX_PLATFORMS=cpu timeout 240 python bench/gpu_compile.py --quick --runs=llama-3-8b:h200:1 \
  --out "$OUT/gpu_compile.json" > "$OUT/gpu_compile.txt" 2>&1 || status=1
grep '^{' "$OUT/gpu_compile.txt" | tail -3
exit $status
