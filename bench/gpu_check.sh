#!/usr/bin/env bash
# Everything that needs a GPU, in one call to the lent machine (one H200; ../shared/GPU.md): the step
# limits add up to 475 s, under the 8 minutes a call can spare. Run from anywhere, on the GPU machine:
#   OUT=/some/dir bash bench/gpu_check.sh          # default OUT: bench/out/gpu
# and to rehearse it on a CPU, every step at small sizes (tests/test_gpu_check.py, in .venv-gpu-rehearsal):
#   bash bench/gpu_check.sh --dry-run              # default OUT: bench/out/gpu-dry-run
# It writes 6 files under $OUT, none in a folder: summary.json (every step: name, rc, wall seconds,
# limit, key figures and the step's whole JSON report; written again as each step ends) and one log
# per step that runs a program (kernel_tests, kernels, e2e, executables, gpu_compile). A short table
# comes last. Before the call, on the CPU machine: `make gpu-executables`, and carry bench/out/gpu_executables.
# Steps run most valuable first, so a call cut short still brings back what matters most.
# $PYTHON picks the interpreter (default: python). Exit status: 0 when every step passed.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY_RUN=0
case "${1:-}" in
  --dry-run) DRY_RUN=1 ;;
  "") ;;
  *) echo "usage: bash bench/gpu_check.sh [--dry-run]" >&2; exit 2 ;;
esac
PY="${PYTHON:-python}"
if [ "$DRY_RUN" = 1 ]; then
  OUT="${OUT:-bench/out/gpu-dry-run}"
  export JAX_PLATFORMS=cpu  # the CUDA plugin is installed (as on the lent machine) but there is no GPU
else
  OUT="${OUT:-bench/out/gpu}"
fi
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# ptxas for the deviceless compile: CUDA 13's nvcc wheel keeps it in nvidia/cu13/bin, off PATH.
if ! command -v ptxas >/dev/null; then
  PTXAS_DIR="$("$PY" -c 'import glob, nvidia; print(next(iter(glob.glob(p + "/cu*/bin") for p in nvidia.__path__), [""])[0])' 2>/dev/null)"
  [ -n "$PTXAS_DIR" ] && [ -x "$PTXAS_DIR/ptxas" ] && export PATH="$PTXAS_DIR:$PATH"
fi
WORK="$(mktemp -d)"  # each step's own JSON, folded into summary.json as the step ends
trap 'rm -rf "$WORK"' EXIT
if [ "$DRY_RUN" = 1 ]; then
  # As on the bare lent machine: jaxserve's caches empty (compiles, saved executables, CPU kernels)
  # and at their defaults, whatever the caller (e.g. the test suite) set.
  export JAXSERVE_CACHE="$WORK/cache"
  unset JAXSERVE_COMPILATION_CACHE JAXSERVE_EXECUTABLES_CACHE JAXSERVE_KERNEL_CACHE
fi
SUMMARY="$OUT/summary.json"
rm -f "$SUMMARY"
MODE=$([ "$DRY_RUN" = 1 ] && echo dry-run || echo gpu)
status=0

# step NAME LIMIT_S REPORT|- COMMAND...: runs COMMAND under LIMIT_S seconds (the GPU run's limit; the
# dry run on a shared 2-core CPU gets $GPU_CHECK_DRY_RUN_SCALE times it), its output in $OUT/NAME.log
# (machine: none), then folds its rc, wall time and REPORT's figures into summary.json.
SCALE=$([ "$DRY_RUN" = 1 ] && echo "${GPU_CHECK_DRY_RUN_SCALE:-4}" || echo 1)
step() {
  local name="$1" gpu_limit="$2" report="$3"; shift 3
  local limit=$((gpu_limit * SCALE))
  local log="$OUT/$name.log" start end rc
  [ "$name" = machine ] && log="$WORK/machine.log"
  echo "== $name (limit ${limit} s)"
  start=$EPOCHREALTIME
  timeout -k 3 "$limit" "$@" > "$log" 2>&1
  rc=$?
  end=$EPOCHREALTIME
  [ "$rc" = 0 ] || status=1
  "$PY" bench/gpu_check_summary.py add "$SUMMARY" --name="$name" --rc="$rc" --timeout="$limit" --gpu-limit="$gpu_limit" \
    --start="$start" --end="$end" --mode="$MODE" --started="$STARTED" \
    $([ "$name" = machine ] || echo --log="$log") $([ "$report" = - ] || echo --report="$report") || status=1
  tail -n 4 "$log"
}
STARTED="$(date -u +%Y-%m-%dT%H:%M:%SZ)"

step machine 15 "$WORK/machine.json" "$PY" bench/gpu_check_summary.py machine "$WORK/machine.json"

# 1. kernel tests, interpret off on the GPU (numerics vs the reference on device: the Triton kernels,
#    then the Mosaic GPU kernels and their engine greedy test, then the grouped matmul vs ragged_dot, so
#    a step cut short loses the least first); the dry run collects the attention tests (imports) and runs
#    one decode and one ragged case of each kernel family with 8B-like heads (Mosaic's in its interpreter).
if [ "$DRY_RUN" = 1 ]; then
  KERNEL_TESTS=("tests/test_kernels.py::test_paged_decode_matches_oracle[ps16-d128-g4-kv1-bfloat16]"
                "tests/test_kernels.py::test_ragged_matches_oracle[ps16-d128-g4-kv1-bfloat16]"
                "tests/test_mosaic_kernels.py::test_mosaic_decode_matches_oracle[ps16-d128-g4-kv1-bfloat16]"
                "tests/test_mosaic_kernels.py::test_mosaic_ragged_matches_oracle[ps16-d128-g4-kv1-bfloat16]")
  step kernel_tests 120 - bash -c '"$0" -m pytest -q --collect-only -p no:cacheprovider tests/test_kernels.py \
    tests/test_mosaic_kernels.py | tail -n 1 && "$0" -m pytest -v -p no:cacheprovider "$@"' "$PY" "${KERNEL_TESTS[@]}"
else
  step kernel_tests 120 - "$PY" -m pytest -v -p no:cacheprovider tests/test_kernels.py tests/test_mosaic_kernels.py \
    tests/test_grouped_matmul.py
fi

# 2. kernel roofline: decode bandwidth vs the copy ceiling, ragged FLOP/s vs the bf16 matmul ceiling,
#    for the Triton and the Mosaic GPU kernels side by side; the grouped matmul (MoE experts) vs XLA's ragged_dot.
step kernels 80 "$WORK/kernels.json" "$PY" bench/kernel_speed.py --out "$WORK/kernels.json" --with-reference \
  $([ "$DRY_RUN" = 1 ] && echo --quick --interpret)

# 3+4. end to end on a random-weight Llama-3-8B-shaped bf16 model (dry run: a tiny bf16 Llama through
#      the interpreted Pallas kernels); planner vs measured device memory.
if [ "$DRY_RUN" = 1 ]; then
  JAXSERVE_ATTENTION_BACKEND=interpret step e2e 185 "$WORK/e2e.json" "$PY" bench/e2e_gpu.py --out "$WORK/e2e.json" --small
else
  step e2e 185 "$WORK/e2e.json" "$PY" bench/e2e_gpu.py --out "$WORK/e2e.json"
fi

# 5. executables compiled for an H200 on the CPU machine (`make gpu-executables` there writes
#    bench/out/gpu_executables with this source and the lent machine's jax; carry that folder), loaded by
#    a tiny engine here and run against one that compiles its own; skipped without the folder. The dry
#    run saves a folder itself and checks it on the CPU, where the engine refuses it (saved for a GPU).
if [ "$DRY_RUN" = 1 ]; then
  step executables 30 "$WORK/executables.json" bash -c '"$0" bench/saved_executables.py save --dir "$1" --target h200 \
    && "$0" bench/saved_executables.py check --dir "$1" --out "$2"' "$PY" "$WORK/gpu_executables" "$WORK/executables.json"
else
  step executables 30 "$WORK/executables.json" "$PY" bench/saved_executables.py check --dir bench/out/gpu_executables \
    --out "$WORK/executables.json"
fi

# 6. the same GPU build compiled deviceless for an H200 (as CI does on the CPU machine), beside 3+4;
#    the dry run compiles the same model for the same target under small engine limits (9 shapes, not 14).
JAX_PLATFORMS=cpu step gpu_compile 45 "$WORK/gpu_compile.json" "$PY" bench/gpu_compile.py --quick \
  $([ "$DRY_RUN" = 1 ] && echo --small) --runs=llama-3-8b:h200:1 --out "$WORK/gpu_compile.json"

echo "== summary ($SUMMARY)"
"$PY" bench/gpu_check_summary.py table "$SUMMARY" || status=1
exit $status
