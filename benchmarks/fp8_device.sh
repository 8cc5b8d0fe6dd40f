#!/usr/bin/env bash
# Issue 44 item 4 (FP8 weights, docs/fp8.md) on the GPU machine: each part fits one 10-minute command. Run from
# the project root after `source .device-pack/setup.sh && source benchmarks/gpu_backend_check/device_env.sh`
# (`steps` needs neither: torch alone):
#
#   bash benchmarks/fp8_device.sh steps   OUT  # engine steps, bf16 then FP8 (one model in memory at a time):
#                                              # thinker decode at 1 and 64 rows, talker frame; ratio FP8 / bf16
#   bash benchmarks/fp8_device.sh tune    OUT  # the thinker's FP8 expert tiles tuned on this GPU (torch alone),
#                                              # written into the package's fused_moe_configs.json, where a
#                                              # `steps` after it in the same command reads them
#   bash benchmarks/fp8_device.sh tune,steps OUT  # parts in turn, each with what is left of BUDGET_S
#   bash benchmarks/fp8_device.sh h100    OUT  # an 80 GB H100: the full model served in FP8, its KV plan against
#                                              # KV_TARGET, closed loop LEVELS, then the open-loop goodput
#   bash benchmarks/fp8_device.sh h200    OUT  # served bf16, then FP8: closed loop COMPARE_LEVELS side by side
#   bash benchmarks/fp8_device.sh goodput OUT  # served bf16, then FP8: the open-loop goodput of each
#
# OUT gets PART.md (the part's tables), PART.json (steps: engine_microbench.json with its `ratios`; tune: the
# package's fused_moe_configs.json with the new entries, to commit; h200 and
# goodput: benchmarks/served_compare.py's FP8-against-bf16 comparison; h100: the closed loop's results.json, and
# h100_goodput.json the open loop's) and PART_logs.tar.gz (serve logs, every bench run's dir): at most four flat
# files a part, so two parts fit in one command's eight. Every step runs under `timeout`, cut from BUDGET_S, so
# the part ends (and packs its files) inside the command's limit; a cut-off bench keeps the levels it finished.
#
# Settings (environment): CONFIG (qwen3_omni_30b_a3b), MODEL_ARGS (serve's and bench's model flags: --device cuda
# --config CONFIG --fast-path on --cuda-graphs on), SERVE_ARGS (more serve flags), BENCH_ARGS (more bench flags),
# BUDGET_S (480: seconds for the whole part, from its start; the setup before it is not counted),
# LEVELS (h100: 1,8,32,64), COMPARE_LEVELS (h200: 32,64), KV_TARGET (200000 thinker KV tokens),
# GOODPUT_START (1), GOODPUT_BISECTIONS (2), GOODPUT_DURATION (20 s a rate; a search tries about 4 rates),
# STEP_ARGS (steps: --device cuda --config CONFIG --batch-sizes 1,64 --prefill-lens 108 --variants pdl --sampling
# served), STEP_STAGES (steps: thinker,talker; in that order, each bf16 then FP8, the files rewritten after each:
# a run cut short before the talker's FP8 part is finished by a second command with STEP_STAGES=talker),
# QUANTIZATIONS (steps: none,fp8; none,fp8,fp8-w8a8 adds the w8a8 kernels, fp8-all the FP8 talker the served
# policy declines), TUNE_TOKENS (tune: 1,16,32,64,128), TUNE_BUDGET_S (tune: 170, the search's seconds; loading,
# the checks and the table come on top, ~30 s).
# CPU, the tiny checkpoint (a test of this script; `omni-triton build tiny` writes checkpoints/tiny first):
#   MODEL_ARGS="--device cpu --checkpoint checkpoints/tiny" BENCH_ARGS=--quick LEVELS=1,2 COMPARE_LEVELS=2 \
#     KV_TARGET=1000 GOODPUT_START=0.5 GOODPUT_BISECTIONS=0 GOODPUT_DURATION=4 \
#     STEP_ARGS="--device cpu --config tiny --batch-sizes 1,4 --prefill-lens 108 --variants pdl" \
#     bash benchmarks/fp8_device.sh PART /tmp/fp8-device
set -uo pipefail
part=${1:?part: steps, tune, h100, h200 or goodput (or several, comma-separated)}
out=${2:?output directory}
if [[ $part == *,* ]]; then  # each part in turn, with what is left of the budget
  status=0
  for one in ${part//,/ }; do
    BUDGET_S=$((${BUDGET_S:-480} - SECONDS)) bash "$0" "$one" "$out" || status=$?
  done
  exit $status
fi
CONFIG=${CONFIG:-qwen3_omni_30b_a3b}
MODEL_ARGS=${MODEL_ARGS:---device cuda --config $CONFIG --fast-path on --cuda-graphs on}
SERVE_ARGS=${SERVE_ARGS:-}
BENCH_ARGS=${BENCH_ARGS:-}
BUDGET_S=${BUDGET_S:-480}
LEVELS=${LEVELS:-1,8,32,64}
COMPARE_LEVELS=${COMPARE_LEVELS:-32,64}
KV_TARGET=${KV_TARGET:-200000}
GOODPUT_START=${GOODPUT_START:-1}
GOODPUT_BISECTIONS=${GOODPUT_BISECTIONS:-2}
GOODPUT_DURATION=${GOODPUT_DURATION:-20}
STEP_ARGS=${STEP_ARGS:---device cuda --config $CONFIG --batch-sizes 1,64 --prefill-lens 108 --variants pdl \
--sampling served}
STEP_STAGES=${STEP_STAGES:-thinker,talker}
QUANTIZATIONS=${QUANTIZATIONS:-none,fp8}
TUNE_TOKENS=${TUNE_TOKENS:-1,16,32,64,128}
TUNE_BUDGET_S=${TUNE_BUDGET_S:-170}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
case $part in
  steps|tune|h100|h200|goodput) ;;
  *) echo "unknown part $part (steps, tune, h100, h200, goodput)"; exit 2 ;;
esac
logs=$out/${part}_logs
summary=$out/$part.md
mkdir -p "$logs"
source benchmarks/device_lib.sh  # left, limit, say, stop_tree, serve, stop_server

finish() {
  stop_tree "$server_pid"
  cat "$summary"
  tar czf "$out/${part}_logs.tar.gz" -C "$out" "${part}_logs" && rm -rf "$logs"
  echo "done after ${SECONDS}s: $(ls "$out" | tr '\n' ' ')"
}
trap finish EXIT
trap 'exit 130' INT TERM

{ echo "# FP8 on the GPU, part $part ($(date -u +%F))"; echo
  echo "GPU: $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -1 || true); git" \
    "$(git rev-parse --short HEAD 2>/dev/null); model: \`$MODEL_ARGS $SERVE_ARGS\`"; echo; } >"$summary"

kv_plan() {  # $1: serve's name: its KV plan line, and the thinker's tokens against KV_TARGET, into the summary
  local line tokens
  line=$(grep -m1 "KV cache:" "$logs/$1.log")
  tokens=$(sed -n 's/.*KV cache: thinker \([0-9]*\) tokens.*/\1/p' <<<"$line")
  { echo "KV plan ($1):"; echo '```'; grep -E "GiB|KV cache" "$logs/$1.log" | head -4; echo '```'
    if [ -n "$tokens" ]; then
      echo "Thinker KV tokens: $tokens ($([ "$tokens" -ge "$KV_TARGET" ] && echo meets || echo MISSES) the" \
        "target of $KV_TARGET)."
    else
      echo "Thinker KV tokens: no per-engine plan in the log ($line)."
    fi; echo; } >>"$summary"
}

closed_loop() {  # $1: run name (dir under logs), $2: levels, $3: timeout
  say "closed loop $1: levels $2"
  timeout -k 10 "$3" python3 -m omni_triton.cli bench --url 127.0.0.1:18001 $MODEL_ARGS $BENCH_ARGS \
    --systems server --concurrency "$2" --label "$1" --out "$logs/$1" >"$logs/$1.bench.log" 2>&1
  say "closed loop $1: exit $?"; tail -3 "$logs/$1.bench.log"
}

open_loop() {  # $1: run name, $2: timeout
  say "goodput $1: search from $GOODPUT_START/s, $GOODPUT_DURATION s a rate"
  timeout -k 10 "$2" python3 -m omni_triton.cli bench --url 127.0.0.1:18001 $MODEL_ARGS $BENCH_ARGS \
    --request-rate auto --goodput-start "$GOODPUT_START" --goodput-bisections "$GOODPUT_BISECTIONS" \
    --duration "$GOODPUT_DURATION" --drain-timeout 60 --label "$1" --out "$logs/$1" >"$logs/$1.bench.log" 2>&1
  say "goodput $1: exit $?"; grep -E "requests/s|pass|fail" "$logs/$1.bench.log" | tail -12
}

results_table() {  # $1: run name: its results.md's tables (without the command and machine lines) into the summary
  { echo "## $1"; echo
    if [ -f "$logs/$1/results.md" ]; then grep -E "^\||^Goodput" "$logs/$1/results.md" | head -40
    else echo "(no results: see ${part}_logs.tar.gz, $1.bench.log)"; fi; echo; } >>"$summary"
}

compare_runs() {  # bf16 and fp8 run dirs side by side into the summary and $out/$part.json
  { echo "## FP8 against bf16"; echo
    python3 benchmarks/served_compare.py "$logs/bf16" "$logs/fp8" --labels bf16,fp8 --out "$out/$part.json" \
      2>&1 || echo "(no comparison: a run is missing)"; echo; } >>"$summary"
}

case $part in
steps)
  say "engine_microbench: $STEP_ARGS --stages $STEP_STAGES --quantization $QUANTIZATIONS"
  timeout -k 10 "$(limit 900 10)" python3 benchmarks/engine_microbench.py $STEP_ARGS --stages "$STEP_STAGES" \
    --quantization "$QUANTIZATIONS" --out-dir "$logs/steps" 2>&1 | tee "$logs/steps.log" | grep -E "^---|^wrote|Error|error"
  say "engine_microbench: exit ${PIPESTATUS[0]}"
  cp "$logs/steps/engine_microbench.json" "$out/steps.json" 2>/dev/null
  cat "$logs/steps/engine_microbench.md" >>"$summary" 2>/dev/null || tail -30 "$logs/steps.log" >>"$summary"
  ;;
tune)
  # into the package's table, so that a `steps` part after this one (a new process) runs the tuned tiles
  say "tune_fused_moe: --quantization fp8 --stages thinker --tokens $TUNE_TOKENS --budget-s $TUNE_BUDGET_S"
  timeout -k 10 "$(limit $((TUNE_BUDGET_S + 90)) 0)" python3 -m omni_triton.bench.tune_fused_moe \
    --quantization fp8 --stages thinker --tokens "$TUNE_TOKENS" --budget-s "$TUNE_BUDGET_S" \
    --out omni_triton/kernels/fused_moe_configs.json 2>&1 | tee "$logs/tune.log" | grep -vE "^  BLOCK_M"
  say "tune_fused_moe: exit ${PIPESTATUS[0]}"
  cp omni_triton/kernels/fused_moe_configs.json "$out/tune.json"
  { echo "Command: \`python -m omni_triton.bench.tune_fused_moe --quantization fp8 --stages thinker --tokens" \
      "$TUNE_TOKENS --budget-s $TUNE_BUDGET_S --out omni_triton/kernels/fused_moe_configs.json\`"; echo
    sed -n '/^NVIDIA\|^| weights\|^|---\|^| fp8\|^e4m3/p' "$logs/tune.log"; echo; } >>"$summary"
  ;;
h100)
  if serve fp8 "$(limit 300 200)" --quantization fp8; then
    kv_plan fp8
    closed_loop fp8 "$LEVELS" "$(limit 240 150)"
    results_table fp8
    open_loop fp8-goodput "$(limit 600 30)"
    results_table fp8-goodput
    stop_server fp8
  fi
  cp "$logs/fp8/results.json" "$out/h100.json" 2>/dev/null
  cp "$logs/fp8-goodput/results.json" "$out/h100_goodput.json" 2>/dev/null
  ;;
h200|goodput)
  # bf16 first, then FP8, each with half of what is left (the second gets the first's leftovers too)
  for run in bf16 fp8; do
    flag=$([ $run = fp8 ] && echo "--quantization fp8")
    share=$([ $run = bf16 ] && echo $(($(left) / 2)) || echo 0)
    if serve $run "$(limit 300 $((share + 60)))" $flag; then
      kv_plan $run
      if [ $part = h200 ]; then
        closed_loop $run "$COMPARE_LEVELS" "$(limit 600 $((share + 30)))"
      else
        open_loop $run "$(limit 600 $((share + 30)))"
      fi
      results_table $run
      stop_server $run
    fi
  done
  compare_runs
  ;;
esac
