#!/usr/bin/env bash
# Issue 43 on a lent machine of several GPUs (one 10-minute command a part), full Qwen3-Omni-30B-A3B dimensions
# with seeded random bf16 weights, closed loop, every layout against one GPU of the same machine. Run from the
# project root after `source .device-pack/setup.sh && source benchmarks/gpu_backend_check/device_env.sh`:
#
#   bash benchmarks/multi_gpu_device.sh two  OUT  # >= 2 GPUs: one GPU (a server on GPU 0), two servers side by
#                                                 # side (GPU 0 and GPU 1, each its own MPS daemon: serve's
#                                                 # --mps auto), one server with --pipelines 2, the split
#                                                 # (thinker GPU 0, talker + code2wav GPU 1)
#   bash benchmarks/multi_gpu_device.sh four OUT  # 4 GPUs: one GPU, four servers side by side, --pipelines 4
#
# A level of several servers runs their benches at once (one `omni-triton bench` per server, same level);
# benchmarks/layout_compare.py sums them. One GPU's streams (seeds 0-3) are saved and every multi-GPU server's
# compared with them (benchmarks/served_device_check.py, which also reads the host-hop counters:
# omni_interstage_host_tensors_total must stay 0). OUT gets PART.md (the layout table, MPS lines, device checks),
# PART.json (layout_compare's) and PART_logs.tar.gz (serve logs, every bench dir). Every step runs under
# `timeout`, cut from BUDGET_S, so the part ends inside the command's limit with what it measured.
#
# Settings (environment): CONFIG, MODEL_ARGS (serve's and bench's model flags), SERVE_ARGS (more serve flags),
# BENCH_ARGS, BUDGET_S (540), PER_GPU (streams per GPU of each multi-GPU level: 32,64), READY_S (300: a start's
# limit). On the CPU (no GPU: every "GPU" is the CPU, which shows the script's steps, not a scaling):
#   MODEL_ARGS="--device cpu --checkpoint checkpoints/tiny" BENCH_ARGS=--quick PER_GPU=1 \
#     bash benchmarks/multi_gpu_device.sh two /tmp/multi-gpu
set -uo pipefail
part=${1:?part: two or four}
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
case $part in two) gpus=2 ;; four) gpus=4 ;; *) echo "unknown part $part (two, four)"; exit 2 ;; esac
logs=$out/${part}_logs
summary=$out/$part.md
mkdir -p "$logs"
source benchmarks/device_lib.sh  # left, limit, say, launch, wait_ready, stop_servers
layouts=()  # layout_compare's --layout arguments, in the order measured (the first: one GPU)

finish() {
  stop_servers
  { echo "## Layouts against one GPU"; echo
    python3 benchmarks/layout_compare.py "${layouts[@]/#/--layout=}" --out "$out/$part.json" 2>&1 \
      || echo "(some runs are missing: see ${part}_logs.tar.gz)"; echo; } >>"$summary"
  cat "$summary"
  tar czf "$out/${part}_logs.tar.gz" -C "$out" "${part}_logs" && rm -rf "$logs"
  echo "done after ${SECONDS}s: $(ls "$out" | tr '\n' ' ')"
}
trap finish EXIT
trap 'exit 130' INT TERM

visible=$(python3 -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
{ echo "# Several GPUs, part $part ($(date -u +%F))"; echo
  echo "GPUs: $visible x $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -1 ||
    true); git $(git rev-parse --short HEAD 2>/dev/null); model: \`$MODEL_ARGS $SERVE_ARGS\`"; echo; } >"$summary"
if [ "$visible" -lt "$gpus" ] && [ "$device" = cuda ]; then
  say "part $part needs $gpus GPUs, $visible visible"; exit 1
fi

bench() {  # $1: server name, $2: run dir name, $3: levels, $4: timeout
  timeout -k 10 "$4" python3 -m omni_triton.cli bench --url "127.0.0.1:$(($(port_of "$1") + 1))" $MODEL_ARGS \
    $BENCH_ARGS --systems server --concurrency "$3" --label "$2" --out "$logs/$2" >"$logs/$2.bench.log" 2>&1
  local status=$?
  say "bench $2 ($1, levels $3): exit $status; $(grep -m1 -E "^\| server" "$logs/$2/results.md" 2>/dev/null)"
}

together() {  # $1: level per server, $2: timeout, then server names: every server's bench at once
  local level=$1 seconds=$2 name pids=() dirs=()
  shift 2
  for name in "$@"; do  # their progress lines to stderr: stdout is the dirs' list
    bench "$name" "$name-c$level" "$level" "$seconds" >&2 & pids+=($!); dirs+=("$logs/$name-c$level")
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
  { echo "Device check of $name (exit $?):"; echo '```'; tail -6 "$logs/$name.device_check.log"; echo '```'; echo
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

# One GPU, then every GPU its own server at once (side by side on one host, each under an MPS daemon that sees
# its GPU: issue 43 item 1); the first server is the one-GPU reference.
side=(one)
for i in $(seq 1 $((gpus - 1))); do side+=("side$i"); done
for i in "${!side[@]}"; do launch "${side[$i]}" "$i" $((18000 + 100 * i)); done
if wait_ready "$(limit "$READY_S" 200)" "${side[@]}"; then
  mps_lines "${side[@]}"
  bench one one "$PER_GPU" "$(limit 180 150)"
  layouts+=("one GPU:1:$logs/one")
  device_check one --audio-out "$logs/one.npz"
  for level in ${PER_GPU//,/ }; do
    [ "$(left)" -gt 150 ] || { say "no time left for $gpus servers at $level streams each"; break; }
    layouts+=("$gpus servers side by side:$gpus:$(together "$level" "$(limit 120 120)" "${side[@]}")")
  done
fi
stop_servers

pipeline_layout() {  # $1: name, $2: GPUs, $3: layout name, then serve flags
  local name=$1 devices=$2 title=$3
  shift 3
  [ "$(left)" -gt 200 ] || { say "no time left for $title"; return 0; }
  launch "$name" "$devices" 18000 "$@"
  if wait_ready "$(limit "$READY_S" 100)" "$name"; then
    mps_lines "$name"
    bench "$name" "$name" "$(levels_of "$gpus")" "$(limit 180 60)"
    layouts+=("$title:$gpus:$logs/$name")
    [ -f "$logs/one.npz" ] && device_check "$name" --compare-audio "$logs/one.npz"
  fi
  stop_servers
}

all_gpus=$(seq -s, 0 $((gpus - 1)))
pipeline_layout pipelines "$all_gpus" "one server, --pipelines $gpus" --pipelines "$gpus"
[ $part = two ] && pipeline_layout split 0,1 "one server, thinker GPU 0, talker + code2wav GPU 1" \
  --stage-gpus thinker=0,talker=1,code2wav=1 --max-inflight $((64 * gpus))  # its streams all in one pipeline
exit 0
