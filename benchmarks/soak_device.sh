#!/usr/bin/env bash
# Issue 48 at full size on the GPU machine: `omni-triton bench --soak` (omni_triton/bench/soak_cli.py) in parts that
# each fit one 10-minute command. Run from the project root after
# `source .device-pack/setup.sh && source benchmarks/gpu_backend_check/device_env.sh`:
#
#   bash benchmarks/soak_device.sh goodput,goodput-mix OUT  # one server: the fixed workload's goodput (bench
#                                                           # --request-rate auto), then the soak mix's (... --mix)
#   bash benchmarks/soak_device.sh goodput-mix,burst OUT    # the mix's goodput, then the burst at 4x it on the warm
#                                                           # server
#   GOODPUT=R bash benchmarks/soak_device.sh soak OUT       # the soak at 0.8 x R for SOAK_S s (a server of its own)
#   GOODPUT=R bash benchmarks/soak_device.sh kill OUT       # KILL_STAGES killed under load, a fresh server each
#   SERVE_ARGS="--admission-max-queue-wait 2" bash benchmarks/soak_device.sh goodput-mix,burst OUT
#                                  # the burst with a queue no longer than ~2 s of starts (docs/load.md): what waited
#                                  # in the default queue (the free slots) kept TTFA high ~19 s after an H200's burst
#
# The burst's, soak's and kills' rates are fractions of a goodput: GOODPUT=R when set, else the goodput of the soak's
# own request mix this command measured (goodput-mix: `bench --request-rate auto --mix` with MIX_ARGS, the mix the
# soak parts run, its seed and options), else the fixed workload's (goodput), else the part fails. The mix's goodput
# is the one to soak at: its requests (thinker tokens 10-400, audio frames 25-500, half of them spoken input) cost the
# server more than the fixed workload's (100 tokens, 250 frames), and 0.8 x the fixed workload's goodput overloaded
# the server with the mix (issue 48: the soak then measured overload, not drift). The summary says which goodput a
# part used, and both goodputs when this command (or an earlier one into the same OUT) measured them. OUT gets
# summary.md (each part's checks and tables), <part>.json (each bench's results.json) and logs.tar.gz (serve logs,
# every bench dir). Every step runs under `timeout`, cut from BUDGET_S (default 585), so the command ends inside its
# limit; the soak's duration is cut to what is left after the server's start (said in the summary).
#
# Settings (environment): CONFIG, MODEL_ARGS (serve's and bench's model flags), SERVE_ARGS, BUDGET_S, GOODPUT,
# GOODPUT_START (4), GOODPUT_MIX_START (GOODPUT_START), GOODPUT_BISECTIONS (2), GOODPUT_DURATION (20), SOAK_S (480),
# SOAK_TAIL_S (70: what the soak's arrivals leave of the budget for the last streams, the checks and the report),
# KILL_STAGES (thinker,talker,code2wav,orchestrator), MIX_ARGS (the request mix's flags, --mix-thinker-tokens,
# --mix-audio-frames, --spoken-fraction, --cancel-fraction, --deadline-fraction, --deadline-s, --arrival-seed: given
# to goodput-mix and to every soak part alike), SOAK_ARGS (more `bench --soak` flags). On the CPU (the script's
# steps):
#   MODEL_ARGS="--device cpu --checkpoint checkpoints/tiny" GOODPUT_START=0.5 GOODPUT_BISECTIONS=0 \
#     GOODPUT_DURATION=4 SOAK_S=30 MIX_ARGS="--mix-thinker-tokens 4-32 --mix-audio-frames 12-100" \
#     bash benchmarks/soak_device.sh goodput,goodput-mix,burst,soak /tmp/soak-device
set -uo pipefail
parts=${1:?parts: goodput, burst, soak, kill (comma-separated)}
out=${2:?output directory}
CONFIG=${CONFIG:-qwen3_omni_30b_a3b}
MODEL_ARGS=${MODEL_ARGS:---device cuda --config $CONFIG --fast-path on --cuda-graphs on}
SERVE_ARGS=${SERVE_ARGS:-}
BUDGET_S=${BUDGET_S:-585}
GOODPUT=${GOODPUT:-}
GOODPUT_START=${GOODPUT_START:-4}
GOODPUT_MIX_START=${GOODPUT_MIX_START:-$GOODPUT_START}
GOODPUT_BISECTIONS=${GOODPUT_BISECTIONS:-2}
GOODPUT_DURATION=${GOODPUT_DURATION:-20}
SOAK_S=${SOAK_S:-480}
SOAK_TAIL_S=${SOAK_TAIL_S:-70}
KILL_STAGES=${KILL_STAGES:-thinker,talker,code2wav,orchestrator}
MIX_ARGS=${MIX_ARGS:-}
SOAK_ARGS=${SOAK_ARGS:-}
for part in ${parts//,/ }; do
  [[ $part =~ ^(goodput|goodput-mix|burst|soak|kill)$ ]] ||
    { echo "unknown part $part (goodput, goodput-mix, burst, soak, kill)"; exit 2; }
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

report() {  # $1: bench dir name: its results.md (without its command and machine lines) and JSON into OUT; $2: a
  # line to put first
  { echo "## $1"; echo
    [ -z "${2:-}" ] || { echo "$2"; echo; }
    if [ -f "$logs/$1/results.md" ]; then grep -vE "^(Command|Machine):" "$logs/$1/results.md" | head -120
    else echo "(no results: logs.tar.gz has $1.bench.log)"; tail -15 "$logs/$1.bench.log"; fi; echo; } >>"$summary"
  cp "$logs/$1/results.json" "$out/$1.json" 2>/dev/null || true
}

needs_server() {  # serve once for the parts that share one (goodput, goodput-mix, burst, soak); $1: seconds
  # the part needs after the server's start
  [ -n "$server_pid" ] && return 0
  serve shared "$(limit 300 "$1")" || { say "no server"; exit 1; }
}

goodput_of() {  # $1: goodput or goodput-mix: the goodput that part measured into OUT (empty: not run, none passed)
  python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['goodput']['requests_per_s'] or '')" \
    "$out/$1.json" 2>/dev/null
}

search_goodput() {  # $1: part name, $2: first rate; then more bench flags (--mix and the mix's)
  local name=$1 start=$2
  shift 2
  needs_server 300
  say "$name: search from $start/s, $GOODPUT_DURATION s a rate${*:+: $*}"
  timeout -k 10 "$(limit 330 60)" python3 -m omni_triton.cli bench --url 127.0.0.1:18001 $MODEL_ARGS \
    --request-rate auto --goodput-start "$start" --goodput-bisections "$GOODPUT_BISECTIONS" \
    --duration "$GOODPUT_DURATION" --drain-timeout 60 "$@" --label "$name" --out "$logs/$name" \
    >"$logs/$name.bench.log" 2>&1
  say "$name: exit $?"; report "$name"
}

soak_bench() {  # $1: name, $2: timeout; then bench --soak flags
  local name=$1 allowed=$2 rate from fixed mix
  shift 2
  fixed=$(goodput_of goodput) mix=$(goodput_of goodput-mix)
  if [ -n "$GOODPUT" ]; then rate=$GOODPUT from="GOODPUT"
  elif [ -n "$mix" ]; then rate=$mix from="the soak mix's goodput (goodput-mix)"
  elif [ -n "$fixed" ]; then rate=$fixed from="the fixed workload's goodput (goodput; the mix's was not measured)"
  else say "$name: no goodput (set GOODPUT or run the goodput-mix part first)"; return 1
  fi
  say "$name: goodput $rate/s, $from: $*"
  timeout -k 10 "$allowed" python3 -m omni_triton.cli bench $MODEL_ARGS --goodput "$rate" --out "$logs/$name" \
    $MIX_ARGS $SOAK_ARGS "$@" >"$logs/$name.bench.log" 2>&1
  say "$name: exit $?"
  report "$name" "Rates: fractions of $rate requests/s, $from. Goodput measured into OUT: the fixed workload's \
${fixed:-not measured}, the soak mix's ${mix:-not measured} (requests/s)."
}

url="--url 127.0.0.1:18001 --metrics-url http://127.0.0.1:18002/metrics"
for part in ${parts//,/ }; do
  case $part in
  goodput)
    search_goodput goodput "$GOODPUT_START"
    ;;
  goodput-mix)
    search_goodput goodput-mix "$GOODPUT_MIX_START" --mix $MIX_ARGS
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
