#!/usr/bin/env bash
# Seconds from launching `jaxserve serve` to /health 200, for several starts in a row (the first
# one fills the caches when they are empty), with each start's warm-up line (shapes compiled,
# loaded from the saved executables, saved); then the same greedy completion sent twice, the first
# as soon as /health says 200 (while the rest of the shapes may still compile), and its latency
# against the second's and against the median of three sent once /health reports every shape compiled.
#   bash bench/start_time.sh [STARTS=3] [PORT=8321] [extra serve flags...]
# JAXSERVE_CACHE=<empty dir> measures a cold start (the model is then fetched and converted too).
set -euo pipefail
starts=${1:-3}; port=${2:-8321}; shift $(( $# < 2 ? $# : 2 ))
jaxserve=${JAXSERVE:-$(dirname "$0")/../.venv/bin/jaxserve}
log=$(mktemp)
trap 'rm -f "$log"' EXIT
for i in $(seq 1 "$starts"); do
  begin=$(date +%s.%N)
  "$jaxserve" serve --port="$port" "$@" >"$log" 2>&1 &
  pid=$!
  until curl -sf "http://127.0.0.1:$port/health" >/dev/null; do
    if ! kill -0 "$pid" 2>/dev/null; then echo "start $i: the server exited"; tail -5 "$log"; exit 1; fi
    sleep 0.1
  done
  ready=$(date +%s.%N)
  request='{"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0, "ignore_eos": true}'
  complete() { curl -sf -o /dev/null -w '%{time_total}' -H 'Content-Type: application/json' -d "$request" \
    "http://127.0.0.1:$port/v1/completions"; }
  latency=("$(complete)" "$(complete)")
  until curl -sf "http://127.0.0.1:$port/health" | python3 -c \
      'import json, sys; w = json.load(sys.stdin).get("warmup") or {}; sys.exit(w.get("compiled") != w.get("total"))'; do
    sleep 0.5
  done
  settled=$(printf '%s\n' "$(complete)" "$(complete)" "$(complete)" | sort -n | sed -n 2p)  # the median of three
  kill "$pid"; wait "$pid" 2>/dev/null || true
  printf 'start %d: /health 200 after %.1f s; %s\n' "$i" "$(echo "$ready - $begin" | bc)" \
    "$(grep -o 'warm-up compiled.*' "$log" | head -1)"
  printf '  16-token completion: first %.2f s, second %.2f s (%.2fx), after the warm-up %.2f s (first %.2fx)\n' \
    "${latency[0]}" "${latency[1]}" "$(echo "${latency[0]} / ${latency[1]}" | bc -l)" "$settled" \
    "$(echo "${latency[0]} / $settled" | bc -l)"
done
