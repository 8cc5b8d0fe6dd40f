#!/usr/bin/env bash
# Served runs side by side in one device call: full_size_sweep.sh's served part for each variant (a tree and serve
# flags), one after the other on the same warm machine, each packed into OUT/<name>.tgz the moment it ends. A call
# returns only what is under $OUT, and only a few files: a call that packs everything at its end loses every run
# when its time runs out first (it happened: three runs, 510 s of device time, nothing back). Run from the project
# root after `source .device-pack/setup.sh && source benchmarks/gpu_backend_check/device_env.sh`:
#
#   LEVELS=64 bash benchmarks/served_variants.sh $OUT "base|.baseline|" "new||" \
#     "talker2||--instances talker=2" "ms8||--admission-max-starting 8"
#
# A variant is NAME|TREE|SERVE_ARGS[|ENV]: TREE a directory with its own copy of the project (e.g. `git archive REV`
# in .baseline; empty: this tree), SERVE_ARGS added to the sweep's SERVE_ARGS, ENV space-separated VAR=VALUE set
# for its run only (e.g. OMNI_TRITON_PYTHON_BACKEND_DIR=/tmp/pb-other: a backend built from another tree's patches,
# `build python-backend --out /tmp/pb-other` run in that tree). Every run is cut at what is left of
# BUDGET_S (default 560 s: a device call's 600 less its start); a variant starts only while RUN_S (default 150 s,
# a full-size server's start, a level and its stop) are left, else it is named as skipped in OUT/variants.txt.
# The sweep's other settings (LEVELS, SEQ_LEVELS, LEFT_CONTEXT, BENCH_ARGS, MODEL_ARGS, PORT, DEVICE_CHECK)
# pass through, and RATES (the open loop at those rates instead of LEVELS: a goodput A/B, e.g. RATES=12,14,16);
# LEFT_CONTEXT defaults to "default" (serve's own) and SEQ_LEVELS to none here. Each .tgz holds the part's
# directory without its rendered repository (results.md/json, bench, serve and server logs, the request traces
# unless over TRACE_PACK_MB, default 100 MB: e.g. the step log's records, `trace.read_records(DIR, "step")`).
# PYSPY="DELAY SECONDS RATE [STREAMS [MODE]]" adds a py-spy profile of every stage stub to each run
# (benchmarks/pyspy_stages.sh: from the server's ready, once the orchestrators hold STREAMS requests when given, plus
# DELAY, SECONDS long, RATE Hz; MODE idle (default: every thread, waits included), gil (only the GIL's holder) or
# native (idle with C/C++ frames; pauses each stub per sample: a low RATE);
# py-spy on PATH, else installed from the carried .whl/py_spy*.whl), in NAME/pyspy/ of its .tgz; then
# python -m omni_triton.bench.pyspy_summary NAME/pyspy. E.g. PYSPY="2 8 200 48" at LEVELS=64: the level's steady
# state.
# Then: tar xzf OUT/NAME.tgz; NAME/served/results.md has the level's table and where its first audio went.
set -uo pipefail
out=${1:?output directory}; shift
[ $# -gt 0 ] || { echo "name at least one variant: NAME|TREE|SERVE_ARGS" >&2; exit 2; }
BUDGET_S=${BUDGET_S:-560}
RUN_S=${RUN_S:-150}
TRACE_PACK_MB=${TRACE_PACK_MB:-100}
export LEFT_CONTEXT=${LEFT_CONTEXT:-default} SEQ_LEVELS=${SEQ_LEVELS-}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
work=$(mktemp -d)  # the runs' full directories (traces included) stay on the machine, not under OUT
if [ -n "${PYSPY:-}" ] && ! command -v py-spy >/dev/null; then  # the carried wheel (a session lost its profiles)
  wheel=$(ls "$root"/.whl/py_spy*.whl 2>/dev/null | head -1)
  [ -n "$wheel" ] && python3 -m pip install -q "$wheel" >/dev/null 2>&1
  command -v py-spy >/dev/null || echo "PYSPY is set but py-spy is not on PATH (pip install .whl/py_spy*.whl)" >&2
fi
mkdir -p "$out"
summary="$out/variants.txt"
: >"$summary"
for variant in "$@"; do
  IFS='|' read -r name tree args envs <<<"$variant"
  read -ra envs <<<"${envs:-}"
  for setting in "${envs[@]}"; do
    [[ "$setting" =~ ^[A-Za-z_][A-Za-z0-9_]*=.*$ ]] ||
      { echo "$name: ENV takes VAR=VALUE words, got '$setting'" >&2; exit 2; }
  done
  case "$name" in
    ''|*[!A-Za-z0-9_.-]*) echo "a variant's name is letters, digits, . _ -: got '$name'" >&2; exit 2 ;;
  esac
  tree=${tree:-$root}
  [ -d "$tree/omni_triton" ] || { echo "$name: no omni_triton package under $tree" >&2; exit 2; }
  left=$((BUDGET_S - SECONDS))
  if [ "$left" -lt "$RUN_S" ]; then
    echo "$name: skipped, ${left} s left of BUDGET_S=$BUDGET_S (a run needs RUN_S=$RUN_S)" | tee -a "$summary"
    continue
  fi
  start=$SECONDS
  spy=
  if [ -n "${PYSPY:-}" ]; then  # waits for this run's server to be ready, then records
    read -r delay seconds rate streams mode <<<"$PYSPY"
    bash "$root/benchmarks/pyspy_stages.sh" "$work/$name/pyspy" "$delay" "$seconds" "$rate" \
      "http://127.0.0.1:${PORT:-18000}" "${mode:-idle}" "${streams:-0}" >"$work/$name.pyspy.log" 2>&1 &
    spy=$!
  fi
  # this tree's sweep script in the variant's directory (`python3 -m` imports the package from there): an older
  # tree's script may lack a fix (before 73a6b29 its server outlived its part and the part hung until its timeout)
  (cd "$tree" && env "${envs[@]}" LABEL=${LABEL_PREFIX:-}$name SERVE_ARGS="${SERVE_ARGS:-} $args" \
     timeout "$left" bash "$root/benchmarks/full_size_sweep.sh" served "$work/$name") >"$work/$name.log" 2>&1
  rc=$?
  if [ -n "$spy" ]; then  # a profile still waiting (the run ended first) must not record the next run's server
    pkill -P "$spy" 2>/dev/null; kill "$spy" 2>/dev/null; wait "$spy" 2>/dev/null
    cp "$work/$name.pyspy.log" "$work/$name/pyspy/" 2>/dev/null
  fi
  cp "$work/$name.log" "$work/$name/sweep.log" 2>/dev/null
  # the request traces come too (the step log's records say what each engine did between its steps), unless
  # they are too big for a returned file (16 MiB, compressed ~10x)
  leave_out=(--exclude=repository)
  trace_mb=$(du -sm "$work/$name/served/trace" 2>/dev/null | cut -f1)
  if [ "${trace_mb:-0}" -gt "$TRACE_PACK_MB" ]; then
    leave_out+=(--exclude=trace)
    echo "$name: its traces (${trace_mb} MB) left out of $name.tgz (TRACE_PACK_MB=$TRACE_PACK_MB)" | tee -a "$summary"
  fi
  tar czf "$out/$name.tgz" -C "$work" "${leave_out[@]}" "$name"
  ran_with="tree $tree, serve args '${SERVE_ARGS:-} $args'${envs[*]:+, env ${envs[*]}}"
  echo "$name: exit $rc in $((SECONDS - start)) s ($ran_with)" | tee -a "$summary"
  grep -h "^| server |" "$work/$name/served/results.md" 2>/dev/null | head -"${SUMMARY_ROWS:-4}" | tee -a "$summary"
done
