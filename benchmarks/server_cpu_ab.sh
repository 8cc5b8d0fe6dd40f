#!/usr/bin/env bash
# Two trees side by side on this machine, alternating (base, new, base, new, ...): each serves the same model, one
# `omni-triton bench` level runs against it, and the server processes' CPU per request is compared (bench's
# server_cpu_ms_per_request: CPU-milliseconds each process spent per completed request). For host-side changes such as
# the orchestrator's per-response work; absolute numbers belong to this machine, the ratio is the result.
#
#   bash benchmarks/server_cpu_ab.sh BASE_TREE NEW_TREE OUT     # e.g. a `git archive main` copy and this tree
#   NEW_SERVE_ARGS="--gil-switch-interval-ms 0.5" bash benchmarks/server_cpu_ab.sh . . OUT   # a flag, one tree
#
# Settings (environment): ROUNDS (2), CONCURRENCY (8), REQUESTS (32), SERVE_ARGS (default: the tiny checkpoint
# on the CPU), BASE_SERVE_ARGS / NEW_SERVE_ARGS (added to one side's serve flags), BENCH_ARGS (default: --checkpoint checkpoints/tiny). Writes OUT/<tree>-<round>/ (bench reports),
# OUT/summary.json and prints a table.
set -uo pipefail
base=$(realpath "${1:?base tree}"); new=$(realpath "${2:?new tree}"); out=$(realpath -m "${3:?output dir}")
ROUNDS=${ROUNDS:-2}; CONCURRENCY=${CONCURRENCY:-8}; REQUESTS=${REQUESTS:-32}
SERVE_ARGS=${SERVE_ARGS:-}; BENCH_ARGS=${BENCH_ARGS:---checkpoint checkpoints/tiny}
python=${PYTHON:-python3}
mkdir -p "$out"
if pgrep -x tritonserver >/dev/null; then  # its processes would be read as the measured server's, or hide them
  echo "a tritonserver is already running here (pgrep -x tritonserver): stop it first"; exit 1
fi
for round in $(seq "$ROUNDS"); do
  for side in base new; do
    tree=$base side_args=${BASE_SERVE_ARGS:-}
    [ $side = new ] && tree=$new side_args=${NEW_SERVE_ARGS:-}
    run="$out/$side-$round"; mkdir -p "$run"
    # exec: $! is the serve process itself, which stops tritonserver on SIGINT
    (cd "$tree" && PYTHONPATH=$tree exec $python -m omni_triton.cli serve $SERVE_ARGS $side_args --http-port 28100 \
       --grpc-port 28101 --metrics-port 28102 --max-inflight 64 --run-dir "$run/server" >"$run/serve.log" 2>&1) &
    server=$!
    ready=0
    for _ in $(seq 900); do
      curl -sf localhost:28100/v2/health/ready >/dev/null && { ready=1; break; }
      kill -0 $server 2>/dev/null || break
      sleep 1
    done
    [ $ready = 1 ] || { echo "$side round $round: server did not become ready (see $run/serve.log)"; exit 1; }
    (cd "$tree" && PYTHONPATH=$tree $python -m omni_triton.cli bench --url 127.0.0.1:28101 $BENCH_ARGS --systems server \
       --concurrency "$CONCURRENCY" --requests-per-level "$REQUESTS" --warmup 2 --out "$run" >"$run/bench.log" 2>&1)
    kill -INT $server; wait $server
  done
done
$python - "$out" "$ROUNDS" <<'PY'
import json, sys
from pathlib import Path

out, rounds = Path(sys.argv[1]), int(sys.argv[2])
rows = []
for round_ in range(1, rounds + 1):
    for side in ("base", "new"):
        result = json.loads((out / f"{side}-{round_}" / "results.json").read_text())["results"][0]
        if not result["server_cpu_ms_per_request"]:
            sys.exit(f"{side} round {round_}: no CPU reading of the server (bench.server_cpu found no single "
                     f"tritonserver serving port 28101)")
        per_request = {name: round(ms, 1) for name, ms in result["server_cpu_ms_per_request"].items()}
        rows.append({"side": side, "round": round_, "requests_per_s": result["requests_per_s"],
                     "ttfa_p50_ms": round(result["ttfa_p50"] * 1e3, 1), "cpu_ms_per_request": per_request})
names = sorted({name for row in rows for name in row["cpu_ms_per_request"]})
print("CPU ms per request, by server process:")
print("| side | round | req/s | TTFA p50 ms | " + " | ".join(names) + " |")
print("|---|---:|---:|---:|" + "---:|" * len(names))
for row in rows:
    print(f"| {row['side']} | {row['round']} | {row['requests_per_s']:.2f} | {row['ttfa_p50_ms']:.0f} | "
          + " | ".join(f"{row['cpu_ms_per_request'].get(name, float('nan')):.1f}" for name in names) + " |")
mean = {side: {name: sum(r["cpu_ms_per_request"].get(name, 0) for r in rows if r["side"] == side) / rounds
               for name in names} for side in ("base", "new")}
ratio = {name: round(mean["new"][name] / mean["base"][name], 3) for name in names if mean["base"][name]}
print("new / base, mean over rounds:", ratio)
(out / "summary.json").write_text(json.dumps({"rows": rows, "ratio_new_to_base": ratio}, indent=2) + "\n")
PY
