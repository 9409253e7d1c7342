#!/usr/bin/env bash
# Everything that needs a GPU, in one call to the lent machine (one H200; ../shared/GPU.md), within
# 8 minutes (the step limits add up to 460 s), most valuable first. Run from the tree, on the GPU machine:
#   OUT=$OUT bash bench/gpu_check.sh                    # default OUT: bench/out/gpu
#   OUT=$OUT bash bench/gpu_check.sh --only=kernels,e2e # a rerun of some steps (the machine step always runs)
# and to rehearse it on a CPU, every step at small sizes (tests/test_gpu_check.py, in .venv-gpu-rehearsal):
#   bash bench/gpu_check.sh --dry-run                   # default OUT: bench/out/gpu-dry-run
# The GPU run exports JAX_PLATFORMS=cuda,cpu: a CUDA that does not start is an error, never a silent
# run on the CPU. Its first step stops the check within seconds when jax sees no GPU ("no GPU found"
# and jax's reason in the summary, exit 2). Before the call, on the CPU machine: `make gpu-executables`,
# and carry bench/out/gpu_executables.
# It writes 8 files under $OUT, none in a folder: summary.json (every step from the start, with its status,
# seconds, limit, checks, key figures and the step's whole JSON report; rewritten as each step starts
# and ends and after every figure a step measures, so a call killed at any moment leaves what finished)
# and one log per step that runs a program (kernel_tests, kernels, agreement, e2e, kv_offload, executables,
# gpu_compile; at most 8 files come back, so lora_pooling's log comes back inside summary.json, as the step's
# log_text). A short table comes last. $PYTHON picks the interpreter (default: python3).
# Exit status: 0 every step ok (the dry run: nothing failed), 1 a step failed or timed out, 2 no GPU
# found (or jax did not start), 3 nothing failed but something was not compared.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY_RUN=0
ONLY=""
for arg in "$@"; do
  case "$arg" in
    --dry-run) DRY_RUN=1 ;;
    --only=*) ONLY=",${arg#--only=}," ;;
    *) echo "usage: bash bench/gpu_check.sh [--dry-run] [--only=step,step,...]" >&2; exit 2 ;;
  esac
done
PY="${PYTHON:-python3}"
command -v "$PY" >/dev/null || { echo "no $PY here (PYTHON=... names another interpreter)" >&2; exit 2; }
if [ "$DRY_RUN" = 1 ]; then
  MODE=dry-run
  OUT="${OUT:-bench/out/gpu-dry-run}"
  export JAX_PLATFORMS=cpu  # the CUDA plugin is installed (as on the lent machine) but there is no GPU
else
  MODE=gpu
  OUT="${OUT:-bench/out/gpu}"
  export JAX_PLATFORMS=cuda,cpu
fi
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
WORK="$(mktemp -d)"  # each step's own JSON (its figures also go into summary.json as measured)
trap 'rm -rf "$WORK"' EXIT
if [ "$DRY_RUN" = 1 ]; then
  # As on the bare lent machine: jaxserve's caches empty (compiles, saved executables, CPU kernels)
  # and at their defaults, whatever the caller (e.g. the test suite) set.
  export JAXSERVE_CACHE="$WORK/cache"
  unset JAXSERVE_COMPILATION_CACHE JAXSERVE_EXECUTABLES_CACHE JAXSERVE_KERNEL_CACHE JAXSERVE_ATTENTION_BACKEND
fi
SUMMARY="$OUT/summary.json"
export GPU_CHECK_SUMMARY="$SUMMARY" GPU_CHECK_MODE="$MODE"  # every step's process asserts the GPU on the GPU run
rm -f "$SUMMARY"
# Every step, in the order it runs: name:limit on the GPU (s):limit in the dry run on a shared 2-core CPU (s).
PLAN="machine:20:120,kernel_tests:110:300,kernels:60:300,agreement:70:400,e2e:100:480,kv_offload:20:120,lora_pooling:40:240,executables:20:600,gpu_compile:20:400"
# The steps whose log comes back inside summary.json (the step's log_text), not as a file of its own.
LOG_IN_SUMMARY=" lora_pooling "
"$PY" bench/gpu_check_summary.py start "$SUMMARY" --mode="$MODE" --plan="$PLAN" || exit 2
declare -A GPU_LIMIT LIMIT
for item in ${PLAN//,/ }; do
  IFS=: read -r name gpu dry <<< "$item"
  GPU_LIMIT[$name]=$gpu
  LIMIT[$name]=$([ "$DRY_RUN" = 1 ] && echo "$dry" || echo "$gpu")
done

# ptxas for the deviceless compiles: the nvidia wheels' bin folders (CUDA 13's nvidia/cu13/bin), the CUDA
# toolkit's bin, PATH; the steps that need it are skipped without it, saying so.
PTXAS_DIR="$("$PY" bench/gpu_check_machine.py ptxas)"
[ -n "$PTXAS_DIR" ] && export PATH="$PTXAS_DIR:$PATH"
NO_PTXAS="no ptxas found (searched the nvidia wheels' bin folders, \$CUDA_HOME/bin, /usr/local/cuda*/bin and PATH)"

skip() {  # skip NAME REASON [not_run]
  "$PY" bench/gpu_check_summary.py skip "$SUMMARY" "$1" --reason="$2" --status="${3:-skipped}"
  echo "== $1: ${3:-skipped}: $2"
}

# step NAME REPORT|- COMMAND...: runs COMMAND under the step's limit, its output in $OUT/NAME.log (the
# machine step's in $WORK; those of $LOG_IN_SUMMARY in $WORK and then in summary.json), then folds its exit
# status, seconds, log and REPORT into summary.json.
step() {
  local name="$1" report="$2"; shift 2
  if [ -n "$ONLY" ] && [ "$name" != machine ] && [[ "$ONLY" != *",$name,"* ]]; then
    skip "$name" "not asked for (--only=${ONLY:1:-1})" not_run
    return
  fi
  local log="$OUT/$name.log" start rc in_summary=""
  [ "$name" = machine ] && log="$WORK/machine.log"
  [[ "$LOG_IN_SUMMARY" == *" $name "* ]] && log="$WORK/$name.log" in_summary=--log-in-summary
  echo "== $name (limit ${LIMIT[$name]} s)"
  "$PY" bench/gpu_check_summary.py begin "$SUMMARY" "$name"
  start=$EPOCHREALTIME
  GPU_CHECK_STEP="$name" timeout -k 5 "${LIMIT[$name]}" "$@" > "$log" 2>&1
  rc=$?
  "$PY" bench/gpu_check_summary.py add "$SUMMARY" --name="$name" --rc="$rc" --timeout="${LIMIT[$name]}" \
    --gpu-limit="${GPU_LIMIT[$name]}" --start="$start" --end="$EPOCHREALTIME" \
    $([ "$name" = machine ] || echo --log="$log") $in_summary $([ "$report" = - ] || echo --report="$report")
  tail -n 4 "$log"
}

finish() {
  echo "== summary ($SUMMARY)"
  "$PY" bench/gpu_check_summary.py table "$SUMMARY"
  "$PY" bench/gpu_check_summary.py exit-status "$SUMMARY"
  exit $?
}

# 0. the machine: packages, ptxas, jax's devices and the attention backend the engine would take. On the
#    GPU run, no GPU (CUDA failed to start, or jax chose another platform) ends the check here.
step machine "$WORK/machine.json" "$PY" bench/gpu_check_machine.py machine "$WORK/machine.json" --mode="$MODE"
if [ "$("$PY" bench/gpu_check_summary.py status "$SUMMARY" machine)" != ok ]; then
  for item in ${PLAN//,/ }; do
    name="${item%%:*}"
    [ "$name" = machine ] || skip "$name" "not run: $([ "$MODE" = gpu ] && echo 'no GPU found' || echo 'jax did not start')" not_run
  done
  "$PY" bench/gpu_check_summary.py table "$SUMMARY"
  exit 2
fi

# 1. kernel tests compiled on the GPU, the subset that matters on hardware (bench/gpu_kernel_tests.py: every
#    kernel, head layout and dtype once, sized to the limit; the rest stays in CI's interpreters). The dry
#    run collects every GPU item and runs one decode and one ragged case of each family interpreted.
step kernel_tests - "$PY" bench/gpu_kernel_tests.py run --mode="$MODE"

# 2. kernel roofline: decode bandwidth vs the copy ceiling, ragged FLOP/s vs the bf16 matmul ceiling, the
#    Triton and Mosaic kernels side by side, each against the plain-jnp reference; the MoE grouped matmul vs
#    XLA's ragged_dot.
step kernels "$WORK/kernels.json" "$PY" bench/kernel_speed.py --out "$WORK/kernels.json" --with-reference \
  $([ "$DRY_RUN" = 1 ] && echo --quick --interpret)

# 3. greedy agreement: a 2-layer model of Llama-3-8B's layers through the XLA path, the Triton and the Mosaic
#    kernels (one engine at a time), each against transformers on the same weights, the kernels also
#    against the XLA path, up to the reference's near-ties.
step agreement "$WORK/agreement.json" "$PY" bench/gpu_agreement.py --out "$WORK/agreement.json" \
  $([ "$DRY_RUN" = 1 ] && echo --small)

# 4. end to end on a random-weight Llama-3-8B-shaped bf16 engine (dry run: a tiny bf16 Llama through the
#    interpreted Pallas kernels): start, planner vs measured memory, offline, decode roofline, serving.
if [ "$DRY_RUN" = 1 ]; then
  JAXSERVE_ATTENTION_BACKEND=interpret step e2e "$WORK/e2e.json" "$PY" bench/e2e_gpu.py --out "$WORK/e2e.json" --small
else
  step e2e "$WORK/e2e.json" "$PY" bench/e2e_gpu.py --out "$WORK/e2e.json"
fi

# 5. KV offload's copies against the host link (bench/kv_offload_bandwidth.py): restores (host -> device, 64
#    and 256 pages of Llama-3-8B's 2 MiB) and saves (device -> host) through HostKVStore, GB/s and their ratio
#    to jax.device_put / np.asarray of as many bytes; the restored pages checked against the saved bytes.
step kv_offload "$WORK/kv_offload.json" "$PY" bench/kv_offload_bandwidth.py --out "$WORK/kv_offload.json" \
  $([ "$DRY_RUN" = 1 ] && echo --small)

# 6. multi-LoRA and embeddings (bench/lora_pooling_gpu.py; issues 50 and 51): on a random-weight Llama-3-8B-shaped
#    model the decode step of 32 rows with 4 adapters of rank 16 against the base step (Triton and Mosaic
#    kernels), and an adapter loaded at run time to its first token; on a SmolLM2-shaped one, 256 inputs of 64
#    tokens embedded by the pooling engine against transformers (torch) in the same process.
step lora_pooling "$WORK/lora_pooling.json" "$PY" bench/lora_pooling_gpu.py --out "$WORK/lora_pooling.json" \
  $([ "$DRY_RUN" = 1 ] && echo --small)

# 7. executables compiled for an H200 on the CPU machine (`make gpu-executables` there, with this source and
#    the lent machine's jax; carry bench/out/gpu_executables), loaded by a tiny engine and compared with one
#    that compiles its own; skipped (never ok) without the folder. The dry run saves a folder for an H200
#    (needs ptxas), which the CPU engine must refuse, and one by an engine here, loaded and compared.
if [ "$DRY_RUN" = 0 ]; then
  step executables "$WORK/executables.json" "$PY" bench/saved_executables.py check --dir bench/out/gpu_executables \
    --out "$WORK/executables.json"
elif [ -z "$PTXAS_DIR" ]; then
  skip executables "$NO_PTXAS: saving executables for an H200 compiles for it"
else
  step executables "$WORK/executables.json" bash -c '"$0" bench/saved_executables.py save --dir "$1/h200" --target h200 \
    && "$0" bench/saved_executables.py save --dir "$1/here" --target here \
    && "$0" bench/saved_executables.py check --dir "$1/here" --refused_elsewhere "$1/h200" --out "$2"' \
    "$PY" "$WORK/executables" "$WORK/executables.json"
fi

# 8. the same GPU build compiled deviceless for an H200 (as CI does on the CPU machine), its corner buckets
#    under small engine limits (9 shapes) and ptxas's report of the kernels.
if [ -z "$PTXAS_DIR" ]; then
  skip gpu_compile "$NO_PTXAS: the deviceless compile runs ptxas"
else
  JAX_PLATFORMS=cpu step gpu_compile "$WORK/gpu_compile.json" "$PY" bench/gpu_compile.py --quick --small \
    --runs=llama-3-8b:h200:1 --out "$WORK/gpu_compile.json"
fi
finish
