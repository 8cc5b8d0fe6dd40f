#!/usr/bin/env bash
# The full-size benchmark (Qwen3-Omni-30B-A3B dimensions, seeded random bf16 weights, one GPU), in parts that
# each fit one 10-minute command on the GPU machine. Run from the project root:
#
#   bash benchmarks/full_size_sweep.sh served       OUT  # serve; bench server (LEVELS) + server-sequential (SEQ_LEVELS)
#   bash benchmarks/full_size_sweep.sh perf         OUT  # serve; perf_analyzer (PERF_LEVELS); then exact context
#   bash benchmarks/full_size_sweep.sh inprocess    OUT  # the in-process pipeline (traced)
#   bash benchmarks/full_size_sweep.sh transformers OUT  # transformers' generate at concurrency 1
#
# Several served runs side by side in one device call (trees, serve flags), each packed as it ends:
# benchmarks/served_variants.sh.
# then merge: omni-triton bench --merge OUT/served OUT/sequential OUT/inprocess OUT/transformers --out ...
# Every bench run writes its results.json after each level, so a part cut short keeps what it measured.
#
# Settings (environment): LEVELS (default 1,4,8,16,32,64), RATES (served: Poisson arrivals at these rates,
# RATE_DURATION s each (default 20), `bench --request-rate`, instead of the closed loop's LEVELS), SEQ_LEVELS (1,4,16; empty: no sequential run),
# LEFT_CONTEXT (code2wav left context: frames, default 25: what transformers' own Code2Wav.chunked_decode uses;
# "exact" = the receptive field, 578 frames; "stateful" = new frames only, the vocoder's state kept by the stage:
# one-pass audio, the serve default; "default" = no flag), PERF_LEVELS (1,4,16,64), EXACT_LEVELS (1,32), CONFIG,
# SERVE_ARGS (more `serve` flags, e.g. "--mps off"), LABEL (the bench's label for the served rows), BENCH_ARGS (more
# flags for the served part's bench), PORT (HTTP port, default 18000; gRPC +1, metrics +2), MODEL_ARGS (the model
# flags of serve and bench, default the full-size config on cuda; tests/test_full_size_sweep.py serves the tiny
# checkpoint on the CPU with "--device cpu"),
# DEVICE_CHECK=1 (served): then benchmarks/served_device_check.py against the same server: 4 sampled streams
# (seeds 0-3) of the sweep's lengths at one stream, the host-hop counters after everything it served, the streams
# saved to OUT/served/device_check.npz; COMPARE_AUDIO=FILE checks them against another server's saved streams.
# Two talker + two code2wav instances against one each on one GPU (docs/scaling.md):
#   LEVELS=32,64 SEQ_LEVELS= LABEL="one instance each" bash benchmarks/full_size_sweep.sh served OUT/one
#   LEVELS=32,64 SEQ_LEVELS= LABEL="talker x2, code2wav x2" SERVE_ARGS="--instances talker=2,code2wav=2" \
#     bash benchmarks/full_size_sweep.sh served OUT/replicas
# (measured: benchmarks/results/h200-replicas/). Two GPUs (issue 24, `nvidia-h200-x2`): thinker on GPU 0, talker
# and code2wav on GPU 1, against every stage on GPU 0 of the same machine (the bench's GPU GiB column then shows
# each GPU after the sum); then the host-hop counters and served-vs-in-process equality at one stream:
#   export LEVELS=1,8,16,32,64 SEQ_LEVELS= LEFT_CONTEXT=default DEVICE_CHECK=1
#   LABEL="one GPU" bash benchmarks/full_size_sweep.sh served OUT/one
#   LABEL="thinker GPU 0, talker + code2wav GPU 1" SERVE_ARGS="--stage-gpus thinker=0,talker=1,code2wav=1" \
#     COMPARE_AUDIO=OUT/one/served/device_check.npz bash benchmarks/full_size_sweep.sh served OUT/split
# (measured: benchmarks/results/h200x2-split/). Two GPUs as one server with a whole pipeline on each (issue 43,
# `nvidia-h200-x2`; serve --pipelines, docs/scaling.md): --max-inflight 64 counts per pipeline, so 128 streams are
# 64 per GPU; against one GPU (and the split, above) on the same machine, audio compared with one GPU's:
#   export SEQ_LEVELS= LEFT_CONTEXT=default DEVICE_CHECK=1
#   LEVELS=32,64 LABEL="one GPU" bash benchmarks/full_size_sweep.sh served OUT/one
#   LEVELS=64,128 LABEL="two pipelines, one per GPU" SERVE_ARGS="--pipelines 2" \
#     COMPARE_AUDIO=OUT/one/served/device_check.npz bash benchmarks/full_size_sweep.sh served OUT/pipelines
set -uo pipefail
part=${1:?part: served, baselines or exact}
out=${2:?output directory}
CONFIG=${CONFIG:-qwen3_omni_30b_a3b}
LEVELS=${LEVELS:-1,4,8,16,32,64}
RATES=${RATES:-}  # set: the served part runs the open loop at these rates instead of the LEVELS
RATE_DURATION=${RATE_DURATION:-20}
PERF_LEVELS=${PERF_LEVELS:-1,4,16,64}
SEQ_LEVELS=${SEQ_LEVELS-1,4,16}  # set empty to skip the sequential levels
EXACT_LEVELS=${EXACT_LEVELS-1,32}
LEFT_CONTEXT=${LEFT_CONTEXT:-25}
export PYTHONUNBUFFERED=1
mkdir -p "$out"

context_args() {  # $1: frames, "exact", "stateful", or "default" (no flag: serve's default)
  [ "$1" = default ] || echo "--left-context-frames $1"
}
SERVE_ARGS=${SERVE_ARGS:-}
BENCH_ARGS=${BENCH_ARGS:-}
MODEL=${MODEL_ARGS:-"--device cuda --config $CONFIG --fast-path on --cuda-graphs on"}
PORT=${PORT:-18000}  # HTTP; gRPC +1, metrics +2
GRPC=127.0.0.1:$((PORT + 1))
omni() { python3 -m omni_triton.cli "$@"; }

stop_leftover_server() {  # a server left by a cut-short run (a `timeout` around this script, a device call that
  # ended first) holds the GPU's memory and these ports: the next serve then fails its placement, or its bench
  # talks to the old server (it happened: a base run measured nothing)
  local pids=() pid
  for pid in $(pgrep -x tritonserver); do  # only servers on this script's ports (other servers are not ours)
    tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q -- "$PORT" && pids+=("$pid")
  done
  [ ${#pids[@]} -gt 0 ] || return 0
  echo "a tritonserver is still running on port $PORT (pid ${pids[*]}): stopping it first"
  kill -INT "${pids[@]}" 2>/dev/null
  for _ in $(seq 30); do kill -0 "${pids[@]}" 2>/dev/null || return 0; sleep 1; done
  kill -KILL "${pids[@]}" 2>/dev/null; sleep 5
}

serve_in_background() {  # $1: left context, $2: run dir; the server traces into $2/trace/server
  stop_leftover_server
  mkdir -p "$2"
  # exec: $! must be the serve process itself, which stops tritonserver on SIGINT. A background job of a script
  # ignores SIGINT, so with a subshell in between (a function run with &) stop_server's SIGINT reached only that
  # subshell and `wait` hung until the device call's timeout, the server still up (seen on the H200, 2026-11-28)
  ( export OMNI_TRITON_TRACE_DIR="$2/trace/server"
    exec python3 -m omni_triton.cli serve $MODEL $(context_args "$1") --max-inflight 64 $SERVE_ARGS \
      --run-dir "$2/run" --http-port $PORT --grpc-port $((PORT + 1)) --metrics-port $((PORT + 2))
  ) >"$2/serve.log" 2>&1 &
  server_pid=$!
  for _ in $(seq 600); do
    if python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/v2/health/ready', timeout=2)" \
        2>/dev/null; then
      echo "server ready after $SECONDS s of this part"; grep -E "KV cache|GiB" "$2/serve.log" | head -5; return 0
    fi
    kill -0 $server_pid 2>/dev/null || break
    sleep 1
  done
  echo "server did not become ready"; tail -40 "$2/serve.log"; return 1
}

stop_server() {
  kill -INT $server_pid 2>/dev/null; wait $server_pid 2>/dev/null
  cp "$1/run/tritonserver.log" "$1/tritonserver.log" 2>/dev/null || true
}

case $part in
served)
  serve_in_background "$LEFT_CONTEXT" "$out/served" || exit 1
  if [ -n "$RATES" ]; then load=(--request-rate "$RATES" --duration "$RATE_DURATION")  # the open loop
  else load=(--concurrency "$LEVELS"); fi
  omni bench --url $GRPC $MODEL $(context_args "$LEFT_CONTEXT") --systems server "${load[@]}" $BENCH_ARGS \
    --trace "$out/served/trace" --out "$out/served" ${LABEL:+--label "$LABEL"} >"$out/served/bench.log" 2>&1
  [ -z "${DEVICE_CHECK:-}" ] || python3 benchmarks/served_device_check.py --url $GRPC \
    --metrics-url http://127.0.0.1:$((PORT + 2))/metrics --device cuda --concurrency 1 --requests 4 --tokens 100 \
    --frames 250 --audio-out "$out/served/device_check.npz" ${COMPARE_AUDIO:+--compare-audio "$COMPARE_AUDIO"} \
    --out "$out/served/device_check.json" >"$out/served/device_check.log" 2>&1
  [ -z "$SEQ_LEVELS" ] || omni bench --url $GRPC $MODEL $(context_args "$LEFT_CONTEXT") \
    --systems server-sequential --concurrency "$SEQ_LEVELS" --out "$out/sequential" >"$out/served/bench-sequential.log" 2>&1
  stop_server "$out/served"
  ;;
perf)
  serve_in_background "$LEFT_CONTEXT" "$out/perf-server" || exit 1
  # perf_analyzer sends no warm-up: without one, its first points paid the fresh server's first-use costs
  # (Triton kernels compiled for new batch shapes, code2wav graphs captured on first use), seconds of TTFA
  omni bench --url $GRPC $MODEL $(context_args "$LEFT_CONTEXT") --systems server --concurrency 16 \
    --requests-per-level 16 --warmup 2 --out "$out/perf-warmup" >"$out/perf-server/warmup.log" 2>&1
  python3 client/perf/run_perf_analyzer.py --url $GRPC --checkpoint "checkpoints/dummy/$CONFIG" \
    --models omni --concurrency "$PERF_LEVELS" --request-rate "" --requests 0 --out "$out/perf" \
    >"$out/perf-server/perf_analyzer.log" 2>&1
  stop_server "$out/perf-server"
  [ -n "$EXACT_LEVELS" ] || exit 0
  serve_in_background exact "$out/exact" || exit 1
  omni bench --url $GRPC $MODEL --systems server --concurrency "$EXACT_LEVELS" \
    --trace "$out/exact/trace" --out "$out/exact" --label "left context exact (578 frames)" >"$out/exact/bench.log" 2>&1
  stop_server "$out/exact"
  ;;
inprocess)
  mkdir -p "$out/inprocess"
  omni bench $MODEL $(context_args "$LEFT_CONTEXT") --systems inprocess --concurrency "$LEVELS" \
    --trace "$out/inprocess/trace" --out "$out/inprocess" >"$out/inprocess/bench.log" 2>&1
  ;;
transformers)
  mkdir -p "$out/transformers"
  omni bench $MODEL --systems transformers --concurrency 1 --requests-per-level "${TRANSFORMERS_REQUESTS:-2}" \
    --warmup 1 --out "$out/transformers" >"$out/transformers/bench.log" 2>&1
  ;;
*)
  echo "unknown part $part (served, perf, inprocess, transformers)"; exit 2
  ;;
esac
