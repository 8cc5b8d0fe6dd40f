#!/usr/bin/env bash
# The served pipeline at full size on one GPU, two trees side by side in one call (same machine, same flags):
# serve defaults + --max-inflight 64, closed-loop LEVELS, request traces, and a 1-second torch.profiler window
# in every stage process in the middle of each level of 32 and more streams (stage_profile.py). Run from the
# project root on the GPU machine, after `source .device-pack/setup.sh` and the backend build
# (benchmarks/gpu_backend_check/device_env.sh):
#   bash benchmarks/capacity/served_ab.sh OUT LABEL=TREE [LABEL=TREE ...]
# e.g. `served_ab.sh $OUT base=.baseline new=.`; each tree is a checkout root (e.g. `git archive`d). Per label:
# OUT/LABEL/served (the bench's results.json/md, logs), OUT/LABEL/profile/cN (Chrome traces, stage_profiles.md).
set -uo pipefail
out=${1:?output directory}
shift
export LEVELS=${LEVELS:-1,32,64} SEQ_LEVELS= LEFT_CONTEXT=default
here=$PWD
profile_levels() {  # $1: bench log, $2: profile dir; a window 3 s into each level of >= 32 streams
  local seen=""
  while sleep 0.5; do
    [ -f "$1" ] || continue
    for level in ${LEVELS//,/ }; do
      [ "$level" -ge 32 ] || continue
      case " $seen " in *" $level "*) continue ;; esac
      if grep -q "concurrency=$level" "$1"; then
        seen="$seen $level"
        (sleep 3; python3 -c "import sys; sys.path.insert(0, '$here'); from omni_triton.stage_profile import request_window; request_window('$2', 'c$level', 1.0)") &
      fi
    done
  done
}
for pair in "$@"; do
  label=${pair%%=*} tree=${pair#*=}
  dir=$out/$label
  mkdir -p "$dir"
  profile_levels "$dir/served/bench.log" "$dir/profile" &
  watcher=$!
  (cd "$tree" && PYTHONPATH=/tmp/site OMNI_TRITON_PROFILE_DIR="$dir/profile" LABEL="$label" \
     bash benchmarks/full_size_sweep.sh served "$dir") > "$dir/sweep.log" 2>&1
  kill $watcher 2>/dev/null
  for window in "$dir"/profile/c*/; do
    [ -d "$window" ] && python3 -m omni_triton.bench.stage_profiles "$window" > /dev/null
  done
  echo "== $label"; sed -n '/^| system/,/^$/p' "$dir/served/results.md" | head -8
done
