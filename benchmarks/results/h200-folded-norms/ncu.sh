#!/bin/bash
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "ncu: $NCU"
PYTHONPATH=$PWD timeout 200 $NCU --clock-control none --profile-from-start off --target-processes all \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy \
  --section LaunchStats --section SchedulerStats --csv --page details python3 benchmarks/results/h200-folded-norms/ncu_gemms.py > $OUT/ncu.csv 2> $OUT/ncu.err
echo "rc=$?"; tail -3 $OUT/ncu.err; wc -l $OUT/ncu.csv
python3 - <<'PY'
import csv, os, collections
rows = list(csv.DictReader(open(os.environ["OUT"] + "/ncu.csv")))
keep = ("Duration", "DRAM Throughput", "L2 Cache Throughput", "L1/TEX Cache Throughput", "Memory Throughput",
        "Compute (SM) Throughput", "Achieved Occupancy", "Registers Per Thread", "Grid Size", "Block Size",
        "Warp Cycles Per Issued Instruction", "Issue Slots Busy", "No Eligible", "Dynamic Shared Memory Per Block")
by = collections.OrderedDict()
for r in rows:
    k = (r.get("ID"), r.get("Kernel Name", "")[:60])
    if any(r.get("Metric Name", "").startswith(m) for m in keep):
        by.setdefault(k, []).append(f'{r["Metric Name"]}={r["Metric Value"]}{r.get("Metric Unit","")}')
for k, v in by.items():
    print(k); print("   " + "; ".join(v))
stalls = [r for r in rows if "Stall" in r.get("Rule Description", "") or r.get("Section Name") == "WarpStateStats"]
for r in stalls[:40]:
    print(r.get("ID"), r.get("Kernel Name","")[:30], r.get("Metric Name"), r.get("Metric Value"), (r.get("Rule Description") or "")[:300])
PY
