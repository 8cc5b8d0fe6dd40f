"""How long one full garbage collection stops a stage process, before and after ``--stage-gc-freeze``'s freeze.

A full collection walks every object the collector tracks and holds the GIL while it does: in a stage's stub every
thread (the engine's steps, the response sends, Triton's execute) waits for it. On an H200 at full size the talker's
engine thread met 150-212 ms ones under load (benchmarks/results/h200-code2wav-switches/README.md). This loads one
stage's service the way its process does (seeded random weights of ``--config``; warm-up as serve runs it: on for
cuda), times ``--rounds`` full collections (``gc.collect()``), freezes what loading left
(``omni_triton.stages.collector.freeze_loaded_objects``), and times as many again; a table on stdout and
gc_freeze_probe.json in ``--out-dir``. The two sets run in one process, one after the other.

    python benchmarks/gc_freeze_probe.py --config tiny                                            # CPU, seconds
    python benchmarks/gc_freeze_probe.py --device cuda --config qwen3_omni_30b_a3b --dtype bfloat16 --out-dir $OUT
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine_microbench import config_dir  # noqa: E402
from omni_triton.pipeline.talker_service import TalkerService  # noqa: E402
from omni_triton.pipeline.thinker_service import ThinkerService  # noqa: E402
from omni_triton.shared.settings import LaunchConfig  # noqa: E402
from omni_triton.stages.collector import freeze_loaded_objects  # noqa: E402
from omni_triton.stages.model_args import engine_config  # noqa: E402

SERVICES = {"talker": TalkerService, "thinker": ThinkerService}


def full_collections_ms(rounds: int) -> list[float]:
    """``rounds`` full collections, each timed alone (ms)."""
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def summary(times: list[float]) -> dict:
    return {"p50_ms": statistics.median(times), "max_ms": max(times), "tracked_objects": len(gc.get_objects()),
            "times_ms": times}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stage", choices=sorted(SERVICES), default="talker")
    parser.add_argument("--config", default="tiny", help="shipped config name, 'tiny', or checkpoint dir")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out-dir", default=".")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    device = torch.device(args.device)
    settings = LaunchConfig(checkpoint_dir=config_dir(args.config, 0), device=device.type, dtype=args.dtype,
                            load_format="dummy")
    config, dtype = engine_config(settings, args.stage, device)
    start = time.monotonic()
    service = SERVICES[args.stage](settings.checkpoint_dir, config, dtype, load_format="dummy")
    load_s = time.monotonic() - start
    gc.unfreeze()  # a process that froze before (none here) would hide the walk being measured
    before = summary(full_collections_ms(args.rounds))
    frozen = freeze_loaded_objects(args.stage)
    after = summary(full_collections_ms(args.rounds))
    service.shutdown()
    result = {"stage": args.stage, "config": args.config, "device": args.device, "dtype": args.dtype,
              "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
              "python": platform.python_version(), "torch": torch.__version__, "load_s": load_s,
              "frozen_objects": frozen, "unfrozen": before, "frozen": after,
              "ratio_p50": after["p50_ms"] / before["p50_ms"] if before["p50_ms"] else None}
    print(f"\n{args.stage}, {args.config} on {args.device} ({args.dtype}), loaded in {load_s:.1f} s; "
          f"{args.rounds} full collections each:\n")
    print("| | objects tracked | full collection p50 ms | max ms |")
    print("|---|---:|---:|---:|")
    for name, row in (("as loaded", before), ("after gc.freeze", after)):
        print(f"| {name} | {row['tracked_objects']} | {row['p50_ms']:.1f} | {row['max_ms']:.1f} |")
    print(f"\nfrozen: {frozen} objects; p50 ratio {result['ratio_p50']:.3f}")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gc_freeze_probe.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
