#!/usr/bin/env bash
# Issue 43 on a lent machine of several GPUs, full Qwen3-Omni-30B-A3B dimensions with seeded random bf16 weights,
# closed loop or goodput (MODE), every layout against one GPU of the same machine. Run from the project root after
# `source .device-pack/setup.sh && source benchmarks/gpu_backend_check/device_env.sh`:
#
#   bash benchmarks/multi_gpu_device.sh PARTS OUT   # PARTS: a comma-separated list of
#     side        one server per GPU (up to SIDE_GPUS, default every GPU), started together, each under its own
#                 MPS daemon (serve's --mps auto): the first alone is the one-GPU reference, then the first two
#                 at once, then all of them at once
#     pipelinesN  one server with --pipelines N on GPUs 0..N-1
#     split       one server, thinker on GPU 0, talker + code2wav on GPU 1 (--stage-gpus)
#
# e.g. `side,pipelines2` in one 10-minute command and `pipelines4,split` in the next, on the same warm machine
# (ONE_AUDIO=the first's one.npz, carried back, for the second's audio checks). A level of several servers runs
# their benches at once (one `omni-triton bench` per server); benchmarks/layout_compare.py sums them. One GPU's
# streams (seeds 0-3) are saved (OUT/one.npz) and every multi-GPU server's compared with them
# (benchmarks/served_device_check.py, which also reads the host-hop counters: omni_interstage_host_tensors_total
# must stay 0). OUT also gets summary.md (the layout table, each server's MPS line and KV plan, the device
# checks), layouts.json (layout_compare's) and logs.tar.gz (serve logs, every bench dir). Every step runs under
# `timeout`, cut from BUDGET_S, so the command ends inside its limit with what it measured.
#
# MODE=goodput: the open loop (`omni-triton bench --request-rate`, Poisson arrivals) instead of the closed loop, at
# RATES requests/s per GPU (each for DURATION s, drained for at most DRAIN_S s): every server of a side-by-side level
# runs its own bench at those rates, all at once; a one-server layout of N GPUs (--pipelines N, the split: N=2) one
# bench at N times them. layout_compare.py sums the servers' rates and gives each layout's goodput (the highest rate
# that passed on every server: TTFA p95 <= 500 ms, none dry, none failed) against one GPU's. The device seconds the
# parts should take (an upper bound: each bench stops at its first failing rate) are estimated and printed first: fit RATES, DURATION and the parts to a command's limit (at the
# defaults `side` in one command, on 2 or 4 GPUs, then `pipelines2,split` in the next, about 380-520 s each;
# ESTIMATE_ONLY=1 prints the estimate and starts nothing).
#
# Settings (environment): CONFIG, MODEL_ARGS (serve's and bench's model flags), SERVE_ARGS (more serve flags),
# BENCH_ARGS, BUDGET_S (540), PER_GPU (streams per GPU of each level: 32,64), READY_S (300: a start's limit),
# SIDE_GPUS, ONE_AUDIO; MODE (closed or goodput), RATES (goodput's requests/s per GPU: 4,6,8,10), DURATION (15),
# DRAIN_S (30). On the CPU (every "GPU" is the CPU: the script's steps, not a scaling):
#   MODEL_ARGS="--device cpu --checkpoint checkpoints/tiny" BENCH_ARGS=--quick PER_GPU=1 SIDE_GPUS=2 \
#     bash benchmarks/multi_gpu_device.sh side,pipelines2 /tmp/multi-gpu
#   MODE=goodput RATES=0.5,1 DURATION=10 MODEL_ARGS="--device cpu --checkpoint checkpoints/tiny" BENCH_ARGS=--quick \
#     SIDE_GPUS=2 bash benchmarks/multi_gpu_device.sh side,pipelines2 /tmp/mg-goodput
set -uo pipefail
parts=${1:?parts: side, pipelinesN, split (comma-separated)}
out=${2:?output directory}
CONFIG=${CONFIG:-qwen3_omni_30b_a3b}
MODEL_ARGS=${MODEL_ARGS:---device cuda --config $CONFIG --fast-path on --cuda-graphs on}
SERVE_ARGS=${SERVE_ARGS:-}
BENCH_ARGS=${BENCH_ARGS:-}
BUDGET_S=${BUDGET_S:-540}
PER_GPU=${PER_GPU:-32,64}
READY_S=${READY_S:-300}
MODE=${MODE:-closed}
RATES=${RATES:-4,6,8,10}
DURATION=${DURATION:-15}
DRAIN_S=${DRAIN_S:-30}  # whole seconds: a passing rate drains in one request's time; one running past this failed
device=$([[ $MODEL_ARGS == *"--device cpu"* ]] && echo cpu || echo cuda)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
for part in ${parts//,/ }; do
  [[ $part =~ ^(side|pipelines[1-9][0-9]*|split)$ ]] || { echo "unknown part $part (side, pipelinesN, split)"; exit 2; }
done
number='[0-9]+(\.[0-9]+)?'
[[ $MODE =~ ^(closed|goodput)$ ]] || { echo "MODE=$MODE: closed or goodput"; exit 2; }
[[ $RATES =~ ^$number(,$number)*$ && $DURATION =~ ^$number$ && $DRAIN_S =~ ^[0-9]+$ ]] ||
  { echo "RATES=$RATES DURATION=$DURATION DRAIN_S=$DRAIN_S: requests/s per GPU (comma-separated) and seconds"; exit 2; }
logs=$out/logs
summary=$out/summary.md
ONE_AUDIO=${ONE_AUDIO:-$out/one.npz}
mkdir -p "$logs"
source benchmarks/device_lib.sh  # left, limit, say, launch, wait_ready, stop_servers
layouts=()  # layout_compare's --layout arguments, in the order measured (the first: one GPU)

# Goodput mode's device seconds, from full-size runs on H200s (a start 75-115 s, a bench's start and warm-up, a
# rate's drain of one request, a device check of 4 streams, a stop); on the CPU from the tiny checkpoint's.
if [ "$device" = cuda ]; then start_s=115 bench_start_s=15 drain_s=10 check_s=25; else
  start_s=90 bench_start_s=15 drain_s=10 check_s=20; fi  # 2 shared cores
stop_s=5
rate_s=$(awk -v d="$DURATION" -v drain="$drain_s" 'BEGIN { print int(d + drain + 0.999) }')  # one rate, drained
rate_count=$(tr , '\n' <<<"$RATES" | wc -l)
bench_s=$((bench_start_s + rate_count * rate_s))  # one open-loop bench over RATES

rates_of() {  # $1: GPUs of one server: RATES times that, as a bench --request-rate list
  awk -v n="$1" -F, '{ for (i = 1; i <= NF; i++) printf "%s%g", (i > 1 ? "," : ""), $i * n }' <<<"$RATES"
}

part_seconds() {  # $1: a part; its device seconds in goodput mode (side: one alone, then 2, then all at once)
  local count=${SIDE_GPUS:-$visible}
  case $1 in
  side) echo $((start_s + bench_s + check_s + (count >= 2 ? bench_s : 0) + (count > 2 ? bench_s : 0) +
    count * stop_s)) ;;
  *) echo $((start_s + bench_s + check_s + stop_s)) ;;
  esac
}

estimate() {  # the goodput parts' device seconds, said before anything starts
  local part total=0 each=()
  for part in ${parts//,/ }; do
    each+=("$part ~$(part_seconds "$part")s"); total=$((total + $(part_seconds "$part")))
  done
  say "[estimate] goodput at $RATES/s per GPU, ${DURATION}s a rate: ${each[*]}: ~${total}s of BUDGET_S=$BUDGET_S" \
    "(a bench: $bench_s s, $rate_count rates of ~${rate_s}s; an overloaded rate drains up to ${DRAIN_S}s more)"
  [ "$total" -le "$BUDGET_S" ] || say "[estimate] over the budget: the last steps will be cut (fewer RATES," \
    "a shorter DURATION, or fewer parts per command)"
}

finish() {
  stop_servers
  { [ "$MODE" = goodput ] && echo "## Goodput of each layout against one GPU" || echo "## Layouts against one GPU"
    echo
    [ ${#layouts[@]} -gt 0 ] && python3 benchmarks/layout_compare.py "${layouts[@]/#/--layout=}" \
      --out "$out/layouts.json" 2>&1 || echo "(runs missing: see logs.tar.gz)"; echo; } >>"$summary"
  cat "$summary"
  tar czf "$out/logs.tar.gz" -C "$out" logs && rm -rf "$logs"
  echo "done after ${SECONDS}s: $(ls "$out" | tr '\n' ' ')"
}
trap finish EXIT
trap 'exit 130' INT TERM

visible=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
{ echo "# Several GPUs: $parts ($(date -u +%F))"; echo
  echo "GPUs: $visible x $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -1 ||
    true); git $(git rev-parse --short HEAD 2>/dev/null); model: \`$MODEL_ARGS $SERVE_ARGS\`"
  [ "$MODE" = goodput ] &&
    echo "Open loop: $RATES requests/s per GPU, $DURATION s of arrivals a rate (drained <= $DRAIN_S s)"
  echo; } >"$summary"
[ "$device" = cuda ] || visible=${SIDE_GPUS:-2}  # on the CPU: as many stand-in "GPUs" as asked
[ "$MODE" = goodput ] && estimate
[ -z "${ESTIMATE_ONLY:-}" ] || { trap - EXIT; rm -r "$logs" "$summary"; exit 0; }

bench() {  # $1: server name, $2: run dir name, $3: levels (closed loop) or rates (goodput), $4: timeout
  local load=(--concurrency "$3") line="^\\| server"  # results.md's row of the first level, or its goodput line
  # a bench stops at its first failing rate: the higher ones cannot be the layout's goodput
  [ "$MODE" = goodput ] && load=(--request-rate "$3" --duration "$DURATION" --drain-timeout "$DRAIN_S"
                                 --stop-after-fail) line="^Goodput:"
  timeout -k 10 "$4" python3 -m omni_triton.cli bench --url "127.0.0.1:$(($(port_of "$1") + 1))" $MODEL_ARGS \
    $BENCH_ARGS --systems server "${load[@]}" --label "$2" --out "$logs/$2" >"$logs/$2.bench.log" 2>&1
  local status=$?
  say "bench $2 ($1, ${load[*]:0:2}): exit $status; $(grep -m1 -E "$line" "$logs/$2/results.md" 2>/dev/null)"
}

together() {  # $1: levels or rates per server, $2: timeout, then server names: every server's bench at once
  local load=$1 seconds=$2 name run pids=() dirs=()
  shift 2
  for name in "$@"; do  # their progress lines to stderr: stdout is the dirs' list
    run=$name-of$#-$([ "$MODE" = goodput ] && echo rates || echo "c$load")
    bench "$name" "$run" "$load" "$seconds" >&2 & pids+=($!); dirs+=("$logs/$run")
  done
  wait "${pids[@]}"
  local IFS=,
  echo "${dirs[*]}"
}

device_check() {  # $1: server name; then served_device_check flags (--audio-out / --compare-audio)
  local name=$1 port
  port=$(port_of "$name"); shift
  timeout -k 10 "$(limit 120 60)" python3 benchmarks/served_device_check.py --url "127.0.0.1:$((port + 1))" \
    --metrics-url "http://127.0.0.1:$((port + 2))/metrics" --device "$device" --concurrency 1 --requests 4 \
    --tokens 100 --frames 250 --out "$logs/$name.device_check.json" "$@" >"$logs/$name.device_check.log" 2>&1
  { echo "Device check of $name (exit $?$([ $# -gt 0 ] && echo "; $*")):"; echo '```'; tail -6 "$logs/$name.device_check.log"; echo '```'; echo
  } >>"$summary"
}

mps_lines() {  # every started server's MPS line and KV plan into the summary
  local name
  { for name in "$@"; do echo "- $name: $(grep -m1 "CUDA MPS" "$logs/$name.log" | sed 's/^ *//'); \
$(grep -m1 "KV cache" "$logs/$name.log" | sed 's/^ *//')"; done; echo; } >>"$summary"
}

levels_of() {  # $1: servers sharing each level: PER_GPU times GPUs per server, as a bench --concurrency list
  local per=$1 level list=()
  for level in ${PER_GPU//,/ }; do list+=($((level * per))); done
  local IFS=,
  echo "${list[*]}"
}

side_by_side() {  # one server per GPU; the first alone (one GPU), then two at once, then all at once
  local count=${SIDE_GPUS:-$visible} i side=(one)
  for i in $(seq 1 $((count - 1))); do side+=("side$i"); done
  for i in "${!side[@]}"; do launch "${side[$i]}" "$([ "$device" = cuda ] && echo "$i")" $((18000 + 100 * i)); done
  if wait_ready "$(limit "$READY_S" 200)" "${side[@]}"; then
    mps_lines "${side[@]}"
    if [ "$MODE" = goodput ]; then bench one one "$RATES" "$(limit $((bench_s + DRAIN_S)) 60)"
    else bench one one "$PER_GPU" "$(limit 180 150)"; fi
    layouts+=("one GPU:1:$logs/one")
    device_check one --audio-out "$ONE_AUDIO"
    local together_counts=(2)
    [ "$count" -gt 2 ] && together_counts+=("$count")
    [ "$count" -ge 2 ] || together_counts=()
    for n in "${together_counts[@]}"; do
      if [ "$MODE" = goodput ]; then  # every server's rate list at once: each server's bench is one GPU's
        [ "$(left)" -gt $((bench_start_s + rate_s + 30)) ] || { say "no time left for $n servers' rates"; break; }
        layouts+=("$n servers side by side:$n:$(together "$RATES" "$(limit $((bench_s + DRAIN_S)) 30)" \
          "${side[@]:0:$n}")")
        continue
      fi
      for level in ${PER_GPU//,/ }; do
        [ "$(left)" -gt 150 ] || { say "no time left for $n servers at $level streams each"; break 2; }
        layouts+=("$n servers side by side:$n:$(together "$level" "$(limit 120 120)" "${side[@]:0:$n}")")
      done
    done
  fi
  stop_servers
}

one_server() {  # $1: name, $2: GPUs, $3: GPU count, $4: layout name, then serve flags
  local name=$1 devices=$2 count=$3 title=$4
  shift 4
  local needed=200  # closed loop: a start and a level; goodput: a start and a rate
  [ "$MODE" = goodput ] && needed=$((start_s + bench_start_s + rate_s + 30))
  [ "$(left)" -gt "$needed" ] || { say "no time left for $title"; return 0; }
  launch "$name" "$([ "$device" = cuda ] && echo "$devices")" 18000 "$@"
  if wait_ready "$(limit "$READY_S" 100)" "$name"; then
    mps_lines "$name"
    if [ "$MODE" = goodput ]; then  # N GPUs' pipelines take N times one GPU's rates
      bench "$name" "$name" "$(rates_of "$count")" "$(limit $((bench_s + DRAIN_S)) 60)"
    else bench "$name" "$name" "$(levels_of "$count")" "$(limit 180 60)"; fi
    layouts+=("$title:$count:$logs/$name")
    [ -f "$ONE_AUDIO" ] && device_check "$name" --compare-audio "$ONE_AUDIO"
  fi
  stop_servers
}

for part in ${parts//,/ }; do
  case $part in
  side) side_by_side ;;
  pipelines*)
    n=${part#pipelines}
    one_server "$part" "$(seq -s, 0 $((n - 1)))" "$n" "one server, --pipelines $n" --pipelines "$n" ;;
  split)
    one_server split 0,1 2 "one server, thinker GPU 0, talker + code2wav GPU 1" \
      --stage-gpus thinker=0,talker=1,code2wav=1 --max-inflight 128 ;;  # one pipeline takes every stream
  esac
done
exit 0
