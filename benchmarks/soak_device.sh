#!/usr/bin/env bash
# Issue 48 at full size on the GPU machine: `omni-triton bench --soak` (omni_triton/bench/soak_cli.py) in parts that
# each fit one 10-minute command. Run from the project root after
# `source .device-pack/setup.sh && source benchmarks/gpu_backend_check/device_env.sh`:
#
#   bash benchmarks/soak_device.sh goodput,burst OUT   # one server: the fixed workload's goodput (bench --request-rate
#                                                      # auto), then the burst at 4x that goodput on the warm server
#   GOODPUT=R bash benchmarks/soak_device.sh soak OUT  # the soak at 0.8 x R for SOAK_S s (a server of its own)
#   GOODPUT=R bash benchmarks/soak_device.sh kill OUT  # KILL_STAGES killed under load, a fresh server each
#
# GOODPUT: a burst or soak without it takes the goodput this command measured (goodput part), else fails. OUT gets
# summary.md (each part's checks and tables), <part>.json (each bench's results.json) and logs.tar.gz (serve logs,
# every bench dir). Every step runs under `timeout`, cut from BUDGET_S (default 585), so the command ends inside its
# limit; the soak's duration is cut to what is left after the server's start (said in the summary).
#
# Settings (environment): CONFIG, MODEL_ARGS (serve's and bench's model flags), SERVE_ARGS, BUDGET_S, GOODPUT,
# GOODPUT_START (4), GOODPUT_BISECTIONS (2), GOODPUT_DURATION (20), SOAK_S (480), SOAK_TAIL_S (70: what the soak's
# arrivals leave of the budget for the last streams, the checks and the report), KILL_STAGES
# (thinker,talker,code2wav,orchestrator), SOAK_ARGS (more `bench --soak` flags). On the CPU (the script's steps):
#   MODEL_ARGS="--device cpu --checkpoint checkpoints/tiny" GOODPUT_START=0.5 GOODPUT_BISECTIONS=0 \
#     GOODPUT_DURATION=4 SOAK_S=30 SOAK_ARGS="--mix-thinker-tokens 4-32 --mix-audio-frames 12-100" \
#     bash benchmarks/soak_device.sh goodput,burst,soak /tmp/soak-device
set -uo pipefail
parts=${1:?parts: goodput, burst, soak, kill (comma-separated)}
out=${2:?output directory}
CONFIG=${CONFIG:-qwen3_omni_30b_a3b}
MODEL_ARGS=${MODEL_ARGS:---device cuda --config $CONFIG --fast-path on --cuda-graphs on}
SERVE_ARGS=${SERVE_ARGS:-}
BUDGET_S=${BUDGET_S:-585}
GOODPUT=${GOODPUT:-}
GOODPUT_START=${GOODPUT_START:-4}
GOODPUT_BISECTIONS=${GOODPUT_BISECTIONS:-2}
GOODPUT_DURATION=${GOODPUT_DURATION:-20}
SOAK_S=${SOAK_S:-480}
SOAK_TAIL_S=${SOAK_TAIL_S:-70}
KILL_STAGES=${KILL_STAGES:-thinker,talker,code2wav,orchestrator}
SOAK_ARGS=${SOAK_ARGS:-}
for part in ${parts//,/ }; do
  [[ $part =~ ^(goodput|burst|soak|kill)$ ]] || { echo "unknown part $part (goodput, burst, soak, kill)"; exit 2; }
done
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
logs=$out/logs
summary=$out/summary.md
mkdir -p "$logs"
source benchmarks/device_lib.sh  # left, limit, say, serve, stop_server
bench() { python3 -m omni_triton.cli bench "$@"; }

finish() {
  stop_servers
  tar czf "$out/logs.tar.gz" -C "$out" logs && rm -rf "$logs"
  cat "$summary"
  echo "done after ${SECONDS}s: $(ls "$out" | tr '\n' ' ')"
}
trap finish EXIT
trap 'exit 130' INT TERM

{ echo "# Soak, burst, killed stages on the GPU: $parts ($(date -u +%F))"; echo
  echo "GPU: $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -1 || true);" \
    "tree ${OMNI_TRITON_GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null)}; model: \`$MODEL_ARGS $SERVE_ARGS\`"
  echo; } >"$summary"

report() {  # $1: bench dir name: its results.md (without its command and machine lines) and JSON into OUT
  { echo "## $1"; echo
    if [ -f "$logs/$1/results.md" ]; then grep -vE "^(Command|Machine):" "$logs/$1/results.md" | head -120
    else echo "(no results: logs.tar.gz has $1.bench.log)"; tail -15 "$logs/$1.bench.log"; fi; echo; } >>"$summary"
  cp "$logs/$1/results.json" "$out/$1.json" 2>/dev/null || true
}

needs_server() {  # serve once for the parts that share one (goodput, burst, soak); $1: seconds the part needs after
  [ -n "$server_pid" ] && return 0
  serve shared "$(limit 300 "$1")" || { say "no server"; exit 1; }
}

measured_goodput() {  # the goodput the goodput part found, else GOODPUT
  [ -n "$GOODPUT" ] && { echo "$GOODPUT"; return; }
  python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['goodput']['requests_per_s'])" \
    "$logs/goodput/results.json" 2>/dev/null
}

soak_bench() {  # $1: name, $2: timeout; then bench --soak flags
  local name=$1 allowed=$2 rate
  shift 2
  rate=$(measured_goodput)
  [ -n "$rate" ] || { say "$name: no goodput (set GOODPUT or run the goodput part first)"; return 1; }
  say "$name: goodput $rate/s: $*"
  timeout -k 10 "$allowed" python3 -m omni_triton.cli bench $MODEL_ARGS --goodput "$rate" --out "$logs/$name" \
    $SOAK_ARGS "$@" >"$logs/$name.bench.log" 2>&1
  say "$name: exit $?"
  report "$name"
}

url="--url 127.0.0.1:18001 --metrics-url http://127.0.0.1:18002/metrics"
for part in ${parts//,/ }; do
  case $part in
  goodput)
    needs_server 300
    say "goodput: search from $GOODPUT_START/s, $GOODPUT_DURATION s a rate"
    timeout -k 10 "$(limit 330 60)" python3 -m omni_triton.cli bench --url 127.0.0.1:18001 $MODEL_ARGS --request-rate auto \
      --goodput-start "$GOODPUT_START" --goodput-bisections "$GOODPUT_BISECTIONS" --duration "$GOODPUT_DURATION" \
      --drain-timeout 60 --label "goodput" --out "$logs/goodput" >"$logs/goodput.bench.log" 2>&1
    say "goodput: exit $?"; report goodput
    ;;
  burst)
    needs_server 90
    soak_bench burst "$(limit 150 10)" $url --soak burst
    ;;
  soak)
    needs_server 100
    duration=$(( $(left) - SOAK_TAIL_S < SOAK_S ? $(left) - SOAK_TAIL_S : SOAK_S ))
    [ "$duration" -ge "$SOAK_S" ] || echo "The soak's arrivals were cut to ${duration} s of ${SOAK_S} (BUDGET_S)." >>"$summary"
    soak_bench soak "$(limit $((SOAK_S + 90)) 5)" $url --soak soak --soak-duration "$duration"
    ;;
  kill)
    stop_servers  # each killed stage gets a fresh server of the bench's own
    soak_bench kill "$(limit 900 5)" --start-server --max-inflight 64 $SERVE_ARGS --soak kill \
      --kill-stages "$KILL_STAGES"
    ;;
  esac
done
