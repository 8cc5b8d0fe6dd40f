#!/usr/bin/env bash
# code2wav's GPU switches side by side in one device call: benchmarks/code2wav_state_bench.py once per combination
# of cuDNN's timed picks (--code2wav-cudnn-autotune), the dilated convs over phases (--code2wav-dilated-phases) and
# the fused SnakeBeta (--code2wav-triton-snake), each with the profile of one call at batch 8; then one table of
# ms per call (eager and CUDA graphs) and each combination's ratio to the first. From the project root:
#
#   bash benchmarks/code2wav_switches.sh $OUT                       # the six default combinations
#   bash benchmarks/code2wav_switches.sh $OUT base:off,off,off phases:off,on,off
#
# A combination is NAME:AUTOTUNE,PHASES,SNAKE (on/off each). Each is packed into OUT/NAME.tgz as it ends (a device
# call returns only a few files: the bench's md/json, its profile and log go inside), the table into OUT/switches.md.
# BATCHES (default 4,8), CONFIG (qwen3_omni_30b_a3b), DTYPE (bfloat16), DEVICE (cuda) pass through; CPU smoke run:
# DEVICE=cpu CONFIG=tiny DTYPE=float32 BATCHES=1 bash benchmarks/code2wav_switches.sh /tmp/switches base:off,off,off
set -uo pipefail
out=${1:?output directory}; shift
combos=("$@")
[ ${#combos[@]} -gt 0 ] || combos=(heuristic:off,off,off phases:off,on,off snake:off,off,on phases-snake:off,on,on
                                   timed:on,off,off timed-snake:on,off,on)
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
export PYTHONPATH=$root:$root/benchmarks${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$out"
work=$(mktemp -d)
names=()
failed=0
for combo in "${combos[@]}"; do
  name=${combo%%:*}
  IFS=, read -r autotune phases snake <<<"${combo#*:}"
  for value in "$autotune" "$phases" "$snake"; do
    [[ "$value" == on || "$value" == off ]] ||
      { echo "$combo: NAME:AUTOTUNE,PHASES,SNAKE takes on/off each, got '$value'" >&2; exit 2; }
  done
  # a device call returns no file whose name has other characters (phases+snake.tgz did not come back)
  [[ "$name" =~ ^[A-Za-z0-9_.-]+$ ]] ||
    { echo "a combination's name is letters, digits, . _ -: got '$name'" >&2; exit 2; }
  start=$SECONDS
  python3 "$root/benchmarks/code2wav_state_bench.py" --device "${DEVICE:-cuda}" --dtype "${DTYPE:-bfloat16}" \
    --config "${CONFIG:-qwen3_omni_30b_a3b}" --batch-sizes "${BATCHES:-4,8}" --profile-batch 8 \
    --cudnn-autotune "$autotune" --dilated-phases "$phases" --triton-snake "$snake" --out-dir "$work/$name" \
    >"$work/$name.log" 2>&1
  status=$?
  echo "$name (autotune $autotune, phases $phases, snake $snake): exit $status in $((SECONDS - start)) s"
  if [ "$status" -ne 0 ]; then
    tail -5 "$work/$name.log" | sed "s/^/  $name: /"
    failed=1
  fi
  mkdir -p "$work/$name" && mv "$work/$name.log" "$work/$name/bench.log"
  tar czf "$out/$name.tgz" -C "$work" "$name"
  names+=("$name")
done
python3 - "$work" "${names[@]}" <<'EOF' | tee "$out/switches.md"
import json, sys
from pathlib import Path

work, names = Path(sys.argv[1]), sys.argv[2:]
results = {}
for name in names:
    path = work / name / "code2wav_state_bench.json"
    if path.is_file():
        results[name] = {row["batch"]: row for row in json.loads(path.read_text())["rows"]}
if not results:
    sys.exit("no combination wrote its results")
first = next(iter(results))
print(f"ms per stateful call of 25 new frames a row; ratio to {first}\n")
print("| combination | batch | eager ms | graph ms | eager ratio | graph ratio |")
print("|---|---:|---:|---:|---:|---:|")
for name, rows in results.items():
    for batch, row in rows.items():
        base = results[first].get(batch, {})
        cells = []
        for key in ("stateful_ms", "stateful_graph_ms"):
            cells.append("-" if row.get(key) is None else f"{row[key]:.2f}")
        for key in ("stateful_ms", "stateful_graph_ms"):
            value, reference = row.get(key), base.get(key)
            cells.append("-" if not value or not reference else f"{value / reference:.2f}")
        print(f"| {name} | {batch} | " + " | ".join(cells) + " |")
EOF
exit $failed
