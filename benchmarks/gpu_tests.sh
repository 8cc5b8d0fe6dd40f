#!/usr/bin/env bash
# Every GPU test, on the GPU machine, in one command (issue 20): the test files with tests that skip without
# CUDA (found by that skip condition, so new GPU tests are picked up), run in one pytest process in the order
# that once broke a capture (kernels, fast path, code2wav graphs, completion graphs, then the rest), then the
# capture/garbage-collector probe. The log goes to $OUT/gpu_tests.log (or /tmp) and is committed under
# benchmarks/results/ beside the change that needed it.
#   run (device): bash benchmarks/gpu_tests.sh
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${OUT:-/tmp}
first="tests/test_kernels.py tests/test_fast_path.py tests/test_code2wav_graphs.py tests/test_completion_graphs.py"
rest=$(grep -l "torch.cuda.is_available()" tests/test_*.py | grep -v -F -x -f <(tr ' ' '\n' <<<"$first") | tr '\n' ' ')
{
  echo "# $(date -u +%FT%TZ) $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) torch $(python3 -c 'import torch; print(torch.__version__)') commit ${OMNI_TRITON_GIT_COMMIT:-unknown (set OMNI_TRITON_GIT_COMMIT)}"
  # server tests (a tritonserver on the CPU-side path) run in CI, not here
  echo "# python3 -m pytest -q -rfEs -p no:cacheprovider -m 'not server' $first $rest"
  PYTHONPATH=$PWD python3 -m pytest -q -rfEs -p no:cacheprovider -m "not server" $first $rest
  status=$?
  echo "# python3 benchmarks/capture_gc_probe.py"
  PYTHONPATH=$PWD python3 benchmarks/capture_gc_probe.py --out "$out/capture_gc_probe.json"
  exit $status
} 2>&1 | tee "$out/gpu_tests.log"
exit "${PIPESTATUS[0]}"
