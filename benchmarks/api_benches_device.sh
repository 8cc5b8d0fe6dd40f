#!/usr/bin/env bash
# Issues 45 and 46 at full size in one command (fits one 10-minute command on the GPU machine): serve the full-size
# model (prefix caching on), the OpenAI API in front of it, benchmarks/realtime_latency.py (end of speech to first
# audio at 1 and 16 sessions, barge-in), benchmarks/prefix_cache_bench.py (five-turn conversation, 32 concurrent
# requests sharing a system prompt); then serve again with --prefix-caching off, the prefix bench again, and the
# two side by side. Run from the project root, after `source .device-pack/setup.sh`:
#
#   bash benchmarks/api_benches_device.sh OUT
#
# OUT gets summary.md (every table), realtime_latency.json, prefix_on.json, prefix_off.json,
# prefix_compare.json and logs.tar.gz (each stage's log, the servers' logs). The API's packages (fastapi,
# uvicorn, websockets, silero-vad, ...) are not on the GPU image: wheels in $API_WHEELS (default .api-wheels,
# carried with the command) are installed to /tmp/site-api first when present (benchmarks/README.md says how to
# make them). Random weights never stop a reply: the API bounds each to REPLY_AUDIO_S seconds of audio
# (--realtime-max-output-audio-s).
#
# Settings (environment): MODEL_ARGS (default: --device cuda --config qwen3_omni_30b_a3b --fast-path on
# --cuda-graphs on), CHECKPOINT (the served checkpoint's dir, its tokenizer: default checkpoints/dummy/CONFIG,
# which `serve --config` writes), SERVE_ARGS (more serve flags), REPLY_AUDIO_S (12), SESSIONS (1,16),
# TURNS (3), BARGE_INS (3), PREFIX (on; off: the realtime bench alone), SYSTEM_TOKENS (1000), TURN_TOKENS (200),
# PREFIX_TURNS (5), CONCURRENCY (32), REQUESTS (64), BUDGET_S (480: the whole run's time; each stage's timeout
# leaves the later stages theirs).
# CPU, the tiny checkpoint (a test of this script, minutes):
#   API_WHEELS=none MODEL_ARGS="--device cpu" CHECKPOINT=checkpoints/tiny SESSIONS=1,2 TURNS=2 BARGE_INS=1 \
#     SYSTEM_TOKENS=200 TURN_TOKENS=40 CONCURRENCY=4 REQUESTS=8 bash benchmarks/api_benches_device.sh /tmp/api-benches
set -uo pipefail
out=${1:?output directory}
CONFIG=${CONFIG:-qwen3_omni_30b_a3b}
MODEL_ARGS=${MODEL_ARGS:---device cuda --config $CONFIG --fast-path on --cuda-graphs on}
CHECKPOINT=${CHECKPOINT:-checkpoints/dummy/$CONFIG}
SERVE_ARGS=${SERVE_ARGS:-}
REPLY_AUDIO_S=${REPLY_AUDIO_S:-12}
SESSIONS=${SESSIONS:-1,16}
TURNS=${TURNS:-3}
BARGE_INS=${BARGE_INS:-3}
SYSTEM_TOKENS=${SYSTEM_TOKENS:-1000}
TURN_TOKENS=${TURN_TOKENS:-200}
PREFIX_TURNS=${PREFIX_TURNS:-5}
CONCURRENCY=${CONCURRENCY:-32}
REQUESTS=${REQUESTS:-64}
PREFIX=${PREFIX:-on}  # off: the realtime bench alone (one server)
BUDGET_S=${BUDGET_S:-480}
API_WHEELS=${API_WHEELS:-.api-wheels}
WAV=benchmarks/assets/utterance_16k.wav  # espeak-ng's sentence, 3 s: the GPU image has no espeak-ng
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$out/logs"
logs=$out/logs
summary=$out/summary.md
server_pid= api_pid= api_path=$PYTHONPATH

source benchmarks/device_lib.sh  # left, limit, say, tree_of, stop_tree, serve, stop_server

finish() {
  stop_tree "$api_pid"; stop_tree "$server_pid"
  tar czf "$out/logs.tar.gz" -C "$out" logs && rm -rf "$logs"
  echo "done after ${SECONDS}s: $(ls "$out" | tr '\n' ' ')"
}
trap finish EXIT
trap 'exit 130' INT TERM

prefix_bench() {  # $1: label (on, off), $2: timeout
  say "prefix_cache_bench $1"
  timeout -k 10 "$2" python3 benchmarks/prefix_cache_bench.py --url 127.0.0.1:18001 \
    --metrics-url http://127.0.0.1:18002/metrics --checkpoint "$CHECKPOINT" --label "$1" \
    --system-tokens "$SYSTEM_TOKENS" --turn-tokens "$TURN_TOKENS" --turns "$PREFIX_TURNS" \
    --concurrency "$CONCURRENCY" --requests "$REQUESTS" --out "$out/prefix_$1.json" >"$logs/prefix_$1.log" 2>&1
  local rc=$?
  say "prefix_cache_bench $1: exit $rc"; [ $rc = 0 ] || tail -20 "$logs/prefix_$1.log"
}

if [ -d "$API_WHEELS" ]; then
  say "installing the API's wheels from $API_WHEELS"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-api \
    "$API_WHEELS"/*.whl >"$logs/pip.log" 2>&1 || { say "pip install failed"; tail -20 "$logs/pip.log"; }
  api_path=/tmp/site-api:$PYTHONPATH  # the API and its client only: the stages keep the image's packages
fi
{ echo "# Realtime latency and prefix caching ($(date -u +%F))"; echo
  echo "serve: \`$MODEL_ARGS --max-inflight 64 $SERVE_ARGS\`; replies at most $REPLY_AUDIO_S s of audio; $(nvidia-smi \
    --query-gpu=name --format=csv,noheader 2>/dev/null | head -1); git $(git rev-parse --short HEAD 2>/dev/null)"
  echo; } >"$summary"

# 1. prefix caching on (serve's default): the realtime bench through the API, then the prefix bench
if serve on "$(limit 240 200)"; then
  say "api"
  PYTHONPATH=$api_path python3 -m omni_triton.cli api --triton-grpc 127.0.0.1:18001 --port 19000 \
    --checkpoint "$CHECKPOINT" --realtime-max-output-audio-s "$REPLY_AUDIO_S" --log-level info \
    >"$logs/api.log" 2>&1 &
  api_pid=$!
  for _ in $(seq 60); do
    url_up http://127.0.0.1:19000/health && break; kill -0 $api_pid 2>/dev/null || break; sleep 1
  done
  if url_up http://127.0.0.1:19000/health; then
    say "realtime_latency: sessions $SESSIONS, $TURNS turns, $BARGE_INS barge-ins"
    PYTHONPATH=$api_path timeout -k 10 "$(limit 180 170)" python3 benchmarks/realtime_latency.py \
      --api-url http://127.0.0.1:19000 --metrics-url http://127.0.0.1:18002/metrics --sessions "$SESSIONS" \
      --turns "$TURNS" --barge-ins "$BARGE_INS" --wav "$WAV" --out "$logs" >"$logs/realtime_latency.log" 2>&1
    say "realtime_latency: exit $?"; tail -5 "$logs/realtime_latency.log"
    cp "$logs/realtime_latency.json" "$out/" 2>/dev/null
  else
    say "api not up"; tail -20 "$logs/api.log"
  fi
  { echo "## Realtime (issue 45): ms, end of speech to first audio; barge-in"; echo; echo '```'
    grep -E "^[0-9]+ sessions:|^barge-in:|Error|error" "$logs/realtime_latency.log" 2>/dev/null | tail -8
    echo '```'; echo; } >>"$summary"
  stop_tree "$api_pid"; api_pid=
  [ "$PREFIX" = on ] && prefix_bench on "$(limit 120 150)"
  stop_server on
fi
[ "$PREFIX" = on ] || { cat "$summary"; exit 0; }

# 2. prefix caching off: the prefix bench again, then both side by side
if serve off "$(limit 240 40)" --prefix-caching off; then
  prefix_bench off "$(limit 120 15)"
  stop_server off
fi
echo "## Prefix caching (issue 46): on vs off" >>"$summary"; echo >>"$summary"
if [ -f "$out/prefix_on.json" ] && [ -f "$out/prefix_off.json" ]; then
  python3 benchmarks/prefix_cache_bench.py --compare "$out/prefix_on.json" "$out/prefix_off.json" \
    --out "$out/prefix_compare.json" >>"$summary" 2>"$logs/compare.log" || tail -5 "$logs/compare.log"
else
  echo "(a run is missing: see logs.tar.gz)" >>"$summary"
fi
cat "$summary"
