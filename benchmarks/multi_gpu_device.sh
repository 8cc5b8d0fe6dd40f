#!/usr/bin/env bash
# Issue 43 on a lent machine of several GPUs, full Qwen3-Omni-30B-A3B dimensions with seeded random bf16 weights,
# closed loop, every layout against one GPU of the same machine. Run from the project root after
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
# Settings (environment): CONFIG, MODEL_ARGS (serve's and bench's model flags), SERVE_ARGS (more serve flags),
# BENCH_ARGS, BUDGET_S (540), PER_GPU (streams per GPU of each level: 32,64), READY_S (300: a start's limit),
# SIDE_GPUS, ONE_AUDIO. On the CPU (every "GPU" is the CPU: the script's steps, not a scaling):
#   MODEL_ARGS="--device cpu --checkpoint checkpoints/tiny" BENCH_ARGS=--quick PER_GPU=1 SIDE_GPUS=2 \
#     bash benchmarks/multi_gpu_device.sh side,pipelines2 /tmp/multi-gpu
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
device=$([[ $MODEL_ARGS == *"--device cpu"* ]] && echo cpu || echo cuda)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
for part in ${parts//,/ }; do
  [[ $part =~ ^(side|pipelines[1-9][0-9]*|split)$ ]] || { echo "unknown part $part (side, pipelinesN, split)"; exit 2; }
done
logs=$out/logs
summary=$out/summary.md
ONE_AUDIO=${ONE_AUDIO:-$out/one.npz}
mkdir -p "$logs"
source benchmarks/device_lib.sh  # left, limit, say, launch, wait_ready, stop_servers
layouts=()  # layout_compare's --layout arguments, in the order measured (the first: one GPU)

finish() {
  stop_servers
  { echo "## Layouts against one GPU"; echo
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
    true); git $(git rev-parse --short HEAD 2>/dev/null); model: \`$MODEL_ARGS $SERVE_ARGS\`"; echo; } >"$summary"
[ "$device" = cuda ] || visible=${SIDE_GPUS:-2}  # on the CPU: as many stand-in "GPUs" as asked

bench() {  # $1: server name, $2: run dir name, $3: levels, $4: timeout
  timeout -k 10 "$4" python3 -m omni_triton.cli bench --url "127.0.0.1:$(($(port_of "$1") + 1))" $MODEL_ARGS \
    $BENCH_ARGS --systems server --concurrency "$3" --label "$2" --out "$logs/$2" >"$logs/$2.bench.log" 2>&1
  local status=$?
  say "bench $2 ($1, levels $3): exit $status; $(grep -m1 -E "^\| server" "$logs/$2/results.md" 2>/dev/null)"
}

together() {  # $1: level per server, $2: timeout, then server names: every server's bench at once
  local level=$1 seconds=$2 name run pids=() dirs=()
  shift 2
  for name in "$@"; do  # their progress lines to stderr: stdout is the dirs' list
    run=$name-of$#-c$level
    bench "$name" "$run" "$level" "$seconds" >&2 & pids+=($!); dirs+=("$logs/$run")
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
    bench one one "$PER_GPU" "$(limit 180 150)"
    layouts+=("one GPU:1:$logs/one")
    device_check one --audio-out "$ONE_AUDIO"
    local together_counts=(2)
    [ "$count" -gt 2 ] && together_counts+=("$count")
    [ "$count" -ge 2 ] || together_counts=()
    for n in "${together_counts[@]}"; do
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
  [ "$(left)" -gt 200 ] || { say "no time left for $title"; return 0; }
  launch "$name" "$([ "$device" = cuda ] && echo "$devices")" 18000 "$@"
  if wait_ready "$(limit "$READY_S" 100)" "$name"; then
    mps_lines "$name"
    bench "$name" "$name" "$(levels_of "$count")" "$(limit 180 60)"
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
