#!/usr/bin/env bash
# ABAB on the CPU: main (its built backend) against the branch firstchunk (the backend with the priority patch)
set -u
out=/work/ab-firstchunk; mkdir -p $out
run() {  # tree label round
  local tree=$1 label=$2 round=$3 env=()
  [ "$label" = firstchunk ] && env=(OMNI_TRITON_PYTHON_BACKEND_DIR=/work/prio-backend)
  (cd $tree && env "${env[@]}" PYTHONPATH=$tree timeout 900 /work/main/.venv/bin/python -P -m omni_triton.cli bench \
     --start-server --checkpoint /tmp/bench/ck --quick --systems server --concurrency 8,16 --max-inflight 16 \
     --requests-per-level 48 --warmup 2 --trace $out/$label-$round/trace --out $out/$label-$round \
     --label "$label round $round" > $out/$label-$round.log 2>&1)
  echo "$label $round rc=$?"
}
for round in 1 2; do
  run /work/main main $round
  run /work/wt-prio firstchunk $round
done
