#!/usr/bin/env bash
# Sampling profiles of every stage's Python stub (py-spy, every thread, raw collapsed stacks) while a served level
# runs: which thread of which stage spends its time where. Starts when the server is ready plus DELAY seconds
# (warm-up requests and the level's ramp), records SECONDS at RATE Hz, non-blocking (the stub is not paused).
#   bash benchmarks/pyspy_stages.sh OUTDIR [DELAY=40] [SECONDS=10] [RATE=200] [HEALTH=http://127.0.0.1:18000] [MODE=idle] \
#     [STREAMS=0] [METRICS=HEALTH's host, its port + 2]
# STREAMS > 0: after the ready, first wait until the orchestrator instances hold STREAMS requests together (the
# level's steady state, not its ramp: omni_triton.bench.wait_for_load on METRICS, at most 300 s), then DELAY.
# then: python -m omni_triton.bench.pyspy_summary OUTDIR   (top frames over all threads, then per thread)
# MODE idle: every thread at every sample, waits included; gil: only the thread holding the GIL (the stub's Python
# time: its all-threads summary is where a stub near 100% of a core spends it); native: as idle, with the C/C++
# frames under each Python one (what a "(no frame)" sample is doing: the stub's own C++, CUDA calls, IPC waits).
# py-spy reads native stacks only with the process paused, so native is not --nonblocking: each sample stops the
# stub for a moment. Use a low RATE (e.g. 50) and compare its timings with an idle run's, not with nothing.
# py-spy is a PyPI wheel (carried to the GPU machine: pip install py_spy-*.whl).
set -uo pipefail
out=${1:?output directory}
delay=${2:-40}; seconds=${3:-10}; rate=${4:-200}; health=${5:-http://127.0.0.1:18000}; mode=${6:-idle}
streams=${7:-0}
port=${health##*:}; metrics=${8:-${health%:*}:$((port + 2))/metrics}
case "$mode" in
  idle|gil) flags=(--nonblocking "--$mode") ;;
  native) flags=(--idle --native) ;;
  *) echo "MODE must be idle, gil or native, got $mode" >&2; exit 2 ;;
esac
mkdir -p "$out"
for _ in $(seq 900); do
  curl -sf "$health/v2/health/ready" >/dev/null 2>&1 && break
  sleep 1
done
if [ "$streams" -gt 0 ]; then
  python3 -m omni_triton.bench.wait_for_load "$metrics" "$streams" 300 || echo "recording anyway" >&2
fi
sleep "$delay"
pids=()
while read -r pid args; do
  model=$(sed -n "s#.*/\([a-z0-9_]*\)/1/model.py.*#\1#p" <<<"$args")
  [ -n "$model" ] || model=$(awk '{print $2}' <<<"$args" | xargs -r basename)
  py-spy record "${flags[@]}" --threads --format raw --rate "$rate" --duration "$seconds" \
    --pid "$pid" --output "$out/$model-$pid.txt" >"$out/$model-$pid.log" 2>&1 &
  pids+=($!)
  echo "$pid $args" >>"$out/stubs.txt"
done < <(ps -ww -eo pid=,args= | grep '[t]riton_python_backend_stub')  # -ww: whole lines, whatever COLUMNS says
top -b -n 1 -H -w 200 | head -60 >"$out/top_threads.txt" 2>/dev/null
wait "${pids[@]}"
echo "py-spy: $(ls "$out"/*.txt | wc -l) files in $out"
