#!/usr/bin/env bash
# Every GPU test, on the GPU machine, in one command (issue 20): the test files with tests that skip without
# CUDA (found by that skip condition, so new GPU tests are picked up), run in one pytest process in the order
# that once broke a capture (kernels, fast path, code2wav graphs, completion graphs, then the rest), then the
# capture/garbage-collector probe. The log goes to $OUT/gpu_tests.log (or /tmp); the latest run's logs are kept in
# benchmarks/results/h200-gpu-tests/ (git history keeps the earlier ones).
#   run (device): bash benchmarks/gpu_tests.sh
# A fresh machine compiles every kernel first: the whole run took 9 min 8 s at da3d8d6, near the device's
# 10-minute limit on one call. It can be split over calls in the same order, each with its own log
# ($OUT/gpu_tests_<part>.log; commit them together):
#   bash benchmarks/gpu_tests.sh first    # the four capture-order files
#   bash benchmarks/gpu_tests.sh rest     # every other GPU test file
#   bash benchmarks/gpu_tests.sh probe    # the capture/garbage-collector probe
# Or all of it in one call, the parts at once on the one GPU (the machine has 16 cores for the kernels' compiles,
# the GPU memory for every test's models several times over; each file's tests still run in one process, and the
# four capture-order files in one process in their order):
#   bash benchmarks/gpu_tests.sh parallel # first | the rest in JOBS - 1 processes (default JOBS=4) | then probe
# Logs: $OUT/gpu_tests_parallel_<group>.log per process, and $OUT/gpu_tests_parallel.log with all of them.
# Its first GPU run (b033116, an H200 that had compiled some of the kernels for benchmarks earlier in its lease):
# 359 passed, 1 skipped in 305 s, the slowest process (the capture-order files) 253 s; on a fresh machine (37694e3,
# every kernel compiled in the run) 312 s, the capture-order files 256 s.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${OUT:-/tmp}
part=${1:-all}
first="tests/test_kernels.py tests/test_fast_path.py tests/test_code2wav_graphs.py tests/test_completion_graphs.py"
rest=$(grep -l "torch.cuda.is_available()" tests/test_*.py | grep -v -F -x -f <(tr ' ' '\n' <<<"$first") | tr '\n' ' ')
pytest_files() {  # the GPU test files given, in one pytest process
  # server tests (a tritonserver on the CPU-side path) run in CI, not here; `-o addopts=`: not the project's xdist
  # workers (the device's Python has no pytest-xdist, and the groups below are the parallelism here)
  echo "# python3 -m pytest -q -rfEs -p no:cacheprovider -o addopts= -m 'not server' $*"
  PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} python3 -m pytest -q -rfEs -p no:cacheprovider -o addopts= -m "not server" "$@"
}
header() {
  echo "# $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) torch $(python3 -c 'import torch; print(torch.__version__)') commit ${OMNI_TRITON_GIT_COMMIT:-unknown (set OMNI_TRITON_GIT_COMMIT)} part $1"
}
if [ "$part" = parallel ]; then
  jobs=${JOBS:-4}
  [ "$jobs" -ge 2 ] || { echo "JOBS must be 2 or more (one process for the capture-order files)" >&2; exit 2; }
  groups=("$first")  # group 0: the capture-order files, in order; the rest dealt round-robin over the others
  i=0
  for file in $rest; do
    g=$(( 1 + i % (jobs - 1) )); groups[$g]="${groups[$g]:-} $file"; i=$((i + 1))
  done
  pids=() names=()
  for g in "${!groups[@]}"; do
    names[$g]=$([ "$g" = 0 ] && echo first || echo "rest$g")
    { header "parallel/${names[$g]}"; pytest_files ${groups[$g]}; } > "$out/gpu_tests_parallel_${names[$g]}.log" 2>&1 &
    pids+=($!)
  done
  status=0
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
  {
    header parallel
    for name in "${names[@]}"; do
      echo "## group $name"; cat "$out/gpu_tests_parallel_$name.log"
    done
    echo "# python3 benchmarks/capture_gc_probe.py"
    PYTHONPATH=$PWD python3 benchmarks/capture_gc_probe.py --out "$out/capture_gc_probe.json" || status=1
    echo "# parallel: exit $status"
    exit "$status"
  } 2>&1 | tee "$out/gpu_tests_parallel.log"
  exit "${PIPESTATUS[0]}"
fi
case "$part" in
  all) files="$first $rest"; log="$out/gpu_tests.log" ;;
  first) files="$first"; log="$out/gpu_tests_first.log" ;;
  rest) files="$rest"; log="$out/gpu_tests_rest.log" ;;
  probe) files=""; log="$out/gpu_tests_probe.log" ;;
  *) echo "usage: bash benchmarks/gpu_tests.sh [all|first|rest|probe|parallel]" >&2; exit 2 ;;
esac
{
  header "$part"
  status=0
  if [ -n "$files" ]; then
    pytest_files $files
    status=$?
  fi
  if [ "$part" = all ] || [ "$part" = probe ]; then
    echo "# python3 benchmarks/capture_gc_probe.py"
    PYTHONPATH=$PWD python3 benchmarks/capture_gc_probe.py --out "$out/capture_gc_probe.json" || status=$?
  fi
  exit $status
} 2>&1 | tee "$log"
exit "${PIPESTATUS[0]}"
