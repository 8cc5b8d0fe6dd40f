#!/usr/bin/env bash
# Cold first burst vs the same burst warm (issue 19, item 3: "the first burst after ready is within 20% of a warm
# one at 8 and 32 streams"), full size on one GPU, one command. Run from the project root:
#
#   bash benchmarks/cold_burst.sh OUT                 # warm start on (the cuda default)
#   WARMUP=off bash benchmarks/cold_burst.sh OUT-off  # the same without it: what warm start removes
#
# For each level N in LEVELS: a fresh server (serve --warmup $WARMUP, the fixed workload's settings), then as soon
# as it reports ready N streams at once (the cold burst: N requests at concurrency N, no warm-up request), then
# WARM_REPEATS more of the same burst (the last is the warm one compared), then the server stops. Writes
# OUT/cold_burst.json (per level: cold and warm TTFA p50/p95, their ratio, requests/s, the server's ready time
# with its warm-up) and prints the table; each burst's own bench report is in OUT/c<N>/<cold|warm<i>>/.
#
# Settings (environment): LEVELS (default "8 32"), WARMUP (on), WARM_REPEATS (2), LEFT_CONTEXT (25; "exact" =
# the vocoder's receptive field), MAX_INFLIGHT (64), CONFIG (qwen3_omni_30b_a3b); MODEL and BENCH_ARGS replace the
# model options and add bench options (a CPU check of the script itself: MODEL="--checkpoint checkpoints/tiny"
# BENCH_ARGS="--quick" LEVELS=2 WARMUP=on), PORT (18000: http, then grpc and metrics). About 2-3 minutes per
# level on an H200 (server start with warm-up, then three bursts of 20-second streams).
set -uo pipefail
out=${1:?output directory}
LEVELS=${LEVELS:-8 32}
WARMUP=${WARMUP:-on}
WARM_REPEATS=${WARM_REPEATS:-2}
LEFT_CONTEXT=${LEFT_CONTEXT:-25}
MAX_INFLIGHT=${MAX_INFLIGHT:-64}
CONFIG=${CONFIG:-qwen3_omni_30b_a3b}
export PYTHONUNBUFFERED=1
mkdir -p "$out"
[ "$LEFT_CONTEXT" = exact ] && context_args="" || context_args="--left-context-frames $LEFT_CONTEXT"
MODEL=${MODEL:-"--device cuda --config $CONFIG --fast-path on --cuda-graphs on $context_args"}
BENCH_ARGS=${BENCH_ARGS:-}
PORT=${PORT:-18000}  # http; grpc and metrics on the next two
omni() { python3 -m omni_triton.cli "$@"; }

for level in $LEVELS; do
  dir="$out/c$level"
  mkdir -p "$dir"
  start=$SECONDS
  # exec: $! must be the serve process, which stops tritonserver on SIGINT (a background subshell ignores SIGINT:
  # the kill below would reach only it, and `wait` would hang with the server up; see full_size_sweep.sh)
  ( exec python3 -m omni_triton.cli serve $MODEL --warmup "$WARMUP" --max-inflight "$MAX_INFLIGHT" \
      --run-dir "$dir/run" --http-port $PORT --grpc-port $((PORT + 1)) --metrics-port $((PORT + 2))
  ) >"$dir/serve.log" 2>&1 &
  server_pid=$!
  ready=""
  for _ in $(seq 900); do
    if python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/v2/health/ready', timeout=2)" \
        2>/dev/null; then
      ready=$((SECONDS - start)); break
    fi
    kill -0 $server_pid 2>/dev/null || break
    sleep 1
  done
  if [ -z "$ready" ]; then
    echo "c$level: server did not become ready"; tail -40 "$dir/serve.log"; kill -INT $server_pid 2>/dev/null
    wait $server_pid 2>/dev/null; exit 1
  fi
  echo "c$level: ready after ${ready} s (warm-up $WARMUP)"; grep -E "warm-up done" "$dir/serve.log"
  echo "$ready" >"$dir/ready_s"
  for run in cold $(seq -f "warm%g" 1 "$WARM_REPEATS"); do
    omni bench --url 127.0.0.1:$((PORT + 1)) $MODEL $BENCH_ARGS --systems server --concurrency "$level" --requests-per-level "$level" \
      --warmup 0 --out "$dir/$run" --label "c$level $run burst (warm-up $WARMUP)" >"$dir/$run.log" 2>&1 \
      || { echo "c$level $run: bench failed"; tail -20 "$dir/$run.log"; }
  done
  kill -INT $server_pid 2>/dev/null; wait $server_pid 2>/dev/null
  cp "$dir/run/tritonserver.log" "$dir/tritonserver.log" 2>/dev/null || true
done

python3 - "$out" "$WARMUP" "$WARM_REPEATS" $LEVELS <<'EOF'
import json, sys
from pathlib import Path

out, warmup, repeats, levels = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4:]


def burst(path):
    try:
        (row,) = [r for r in json.loads((path / "results.json").read_text())["results"] if r["system"] == "server"]
    except (OSError, ValueError, KeyError):
        return None
    return {key: row[key] for key in ("ttfa_p50", "ttfa_p95", "requests_per_s", "requests", "failed")}


summary = {"warmup": warmup, "levels": {}}
print(f"| streams | ready (s) | cold TTFA p50 / p95 (ms) | warm TTFA p50 / p95 (ms) | cold / warm p50 | target <= 1.2 |")
print("|---:|---:|---:|---:|---:|---|")
for level in levels:
    dir = out / f"c{level}"
    cold, warm = burst(dir / "cold"), burst(dir / f"warm{repeats}")
    ratio = cold["ttfa_p50"] / warm["ttfa_p50"] if cold and warm else None
    ready = float((dir / "ready_s").read_text()) if (dir / "ready_s").is_file() else None
    summary["levels"][level] = {"ready_s": ready, "cold": cold, "warm": warm, "cold_over_warm_ttfa_p50": ratio}
    ms = lambda b: "n/a" if b is None else f"{1e3 * b['ttfa_p50']:.0f} / {1e3 * b['ttfa_p95']:.0f}"
    print(f"| {level} | {ready} | {ms(cold)} | {ms(warm)} | {'n/a' if ratio is None else f'{ratio:.2f}'} | "
          f"{'n/a' if ratio is None else ('met' if ratio <= 1.2 else 'missed')} |")
(out / "cold_burst.json").write_text(json.dumps(summary, indent=2) + "\n")
print(f"wrote {out / 'cold_burst.json'}")
EOF
