"""``kernels.small_linear`` alone at the code predictor's shapes: the one-pass kernel against the split-K launch
and the multiply-add GEMV (``gemv=True``, up to ``GEMV_MAX_ROWS`` rows), per call, next to the weight-read floor
(the question: how close does each bring a call to HBM bandwidth, and at which ``TARGET_PROGRAMS`` /
``GEMV_MIN_PROGRAMS``).

    python benchmarks/small_linear_bench.py --out-dir benchmarks/results/NAME
    python benchmarks/small_linear_bench.py --rows 1,2 --targets 256,512,1024 --out-dir $OUT/sl   # tuning

Per layer (qkv with its norm, o + residual, gate/up with norm and SiLU gate, down + residual, norm + lm_head to
fp32) and row count: microseconds per call of ``split_k=1`` and of the split plan at each ``--targets`` value of
``TARGET_PROGRAMS``, of the GEMV at each ``--gemv-programs`` value of ``GEMV_MIN_PROGRAMS``, the programs each
launches, and the weight bytes read per second. The floor is the weight
bytes over the copy bandwidth measured in the same run. Each timing replays a CUDA graph of calls that cycle
through enough weight copies (>= 4x the L2 cache) that every call reads its weights from HBM, as the frame's
15 steps of ~150 MB do. CUDA only. Writes small_linear_bench.{json,md}.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton

from engine_microbench import graph_seconds_per_call, measure_ceilings
from omni_triton.kernels import small_linear as small_linear_module
from omni_triton.kernels.small_linear import GEMV_MAX_ROWS, gemv_blocks, launch_plan, small_linear

# name -> (K, N, fusion) of the released predictor (hidden 1024, 16/8 heads x 128, MLP 3072, 2048 codes)
LAYERS = {"qkv": (1024, 4096, "norm"), "o": (2048, 1024, "residual"), "gate_up": (1024, 3072, "gated-norm"),
          "down": (3072, 1024, "residual"), "lm_head": (1024, 2048, "norm-fp32-out")}
CALLS_PER_GRAPH = 64


def layer_calls(rows: int, depth: int, cols: int, fusion: str, min_bytes: int) -> tuple[list, int]:
    """(argument sets of one layer's calls, each with its own weight copy, weight bytes of one call)."""
    device, dtype = torch.device("cuda"), torch.bfloat16
    gated = "gated" in fusion
    weight_rows = 2 * cols if gated else cols
    weight_bytes = weight_rows * depth * 2
    copies = max(1, min(CALLS_PER_GRAPH, -(-min_bytes // weight_bytes)))
    x = torch.randn(rows, depth, device=device, dtype=dtype)
    kwargs = dict(gated=gated)
    if "norm" in fusion:
        kwargs.update(norm_weight=torch.ones(depth, device=device, dtype=dtype), eps=1e-6)
    if fusion == "residual":
        kwargs.update(residual=torch.randn(rows, cols, device=device, dtype=dtype))
    if fusion.endswith("fp32-out"):
        kwargs.update(out_dtype=torch.float32)
    weights = [torch.randn(weight_rows, depth, device=device, dtype=dtype) / depth ** 0.5 for _ in range(copies)]
    return [(x, weights[i % copies], kwargs) for i in range(CALLS_PER_GRAPH)], weight_bytes


def seconds_per_call(calls: list, split_k: int | None, gemv: bool, repeat: int = 5, tile=None,
                     cublas: bool = False) -> float:
    """Median over ``repeat`` replays of a CUDA graph of ``calls`` (made eagerly first: compiled, scratch made)."""
    def issue_calls():
        for x, weight, kwargs in calls:
            small_linear(x, weight, split_k=split_k, gemv=gemv, tile=tile, cublas=cublas, **kwargs)

    return graph_seconds_per_call(issue_calls, len(calls), repeat)


def programs(rows: int, depth: int, cols: int, fusion: str, split_k: int | None, gemv: bool) -> int:
    if gemv and rows <= GEMV_MAX_ROWS:
        return triton.cdiv(cols, gemv_blocks(rows, cols, depth)[1])
    blocks, splits, _, _ = launch_plan(rows, cols, depth, "norm" in fusion, "gated" in fusion, split_k)
    return triton.cdiv(cols, blocks[1]) * triton.cdiv(rows, blocks[0]) * splits


def bench(rows_list: list[int], targets: list[int], gemv_programs: list[int], bandwidth: float) -> list[dict]:
    l2_bytes = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 * 2 ** 20)
    results = []
    for rows in rows_list:
        for name, (depth, cols, fusion) in LAYERS.items():
            calls, weight_bytes = layer_calls(rows, depth, cols, fusion, 4 * l2_bytes)
            row = dict(layer=name, rows=rows, K=depth, N=cols, weight_mb=weight_bytes / 1e6,
                       floor_us=1e6 * weight_bytes / bandwidth, runs={})
            configs = ([("one-pass", 1, None, False)] + [(f"split@{t}", None, t, False) for t in targets]
                       + [(f"gemv@{p}", None, p, True) for p in gemv_programs if rows <= GEMV_MAX_ROWS])
            for label, split_k, target, gemv in configs:
                knob = "GEMV_MIN_PROGRAMS" if gemv else "TARGET_PROGRAMS"
                default = getattr(small_linear_module, knob)
                setattr(small_linear_module, knob, target or default)
                try:
                    seconds = seconds_per_call(calls, split_k, gemv)
                    launched = programs(rows, depth, cols, fusion, split_k, gemv)
                finally:
                    setattr(small_linear_module, knob, default)
                row["runs"][label] = dict(us=1e6 * seconds, programs=launched, gb_s=weight_bytes / seconds / 1e9)
            results.append(row)
            del calls
            torch.cuda.empty_cache()
    return results


# (BLOCK_N, BLOCK_K, num_warps, num_stages) tried by --sweep-tiles, each at BLOCK_M = the rows' (capped at 64
# and at 128)
TILES = ([(n, k, w, 3) for n in (16, 32, 64) for k in (64, 128, 256) for w in (4, 8)]
         + [(32, 128, 4, 4), (16, 256, 4, 4)])
# --deep: short K steps in deep pipelines instead (what cuBLAS's kernels at these shapes do: K tiles of 64 in
# 10-15 stages), so more weight bytes are in flight per program than TILES' 3-4 stages keep
DEEP_TILES = [(n, k, 4, stages) for n in (16, 32, 64) for k, stages in ((64, 6), (64, 8), (64, 12), (128, 6))]
# with --splits past 1: the tiles tried at each split count (fewer: every split count is another compile);
# wider column blocks than ``block_sizes``' 16 for the narrow layers, so fewer programs re-read all of x
SPLIT_TILES = [(n, k, 4, 3) for n in (16, 32, 64) for k in (128, 256)]


def sweep_tiles(rows_list: list[int], bandwidth: float, layers: list[str], splits: list[int],
                tiles: list = TILES) -> list[dict]:
    """The MMA kernel at every tile of ``tiles`` (one pass) per layer and row count, and with ``splits`` past 1
    at every tile of ``SPLIT_TILES`` split that many ways: the fastest against the default (``launch_plan``)
    and the served launch (cuBLAS for the wide layers from ``CUBLAS_MIN_ROWS`` rows), for the table
    ``small_linear`` should read."""
    l2_bytes = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 * 2 ** 20)
    results = []
    for rows in rows_list:
        for name in layers:
            depth, cols, fusion = LAYERS[name]
            calls, weight_bytes = layer_calls(rows, depth, cols, fusion, 4 * l2_bytes)
            default_us = 1e6 * seconds_per_call(calls, None, False)
            served_us = 1e6 * seconds_per_call(calls, None, True, cublas=True)
            timed = []
            for block_m in sorted({min(128, max(16, triton.next_power_of_2(rows))), min(64, max(16, rows))}):
                for split_k in splits:
                    for block_n, block_k, warps, stages in (tiles if split_k == 1 else SPLIT_TILES):
                        tile = (block_m, block_n, block_k, warps, stages)
                        try:
                            us = 1e6 * seconds_per_call(calls, split_k, False, tile=tile)
                        except Exception as error:  # out of shared memory / registers: not a candidate
                            print(f"  {name} rows {rows} tile {tile} split {split_k}: {error}"[:200])
                            continue
                        timed.append((us, tile + (split_k,)))
            best_us, best = min(timed)
            results.append(dict(layer=name, rows=rows, K=depth, N=cols, floor_us=1e6 * weight_bytes / bandwidth,
                                default_us=default_us, served_us=served_us, best_us=best_us,
                                best_tile_and_splits=best,
                                tiles={str(t): us for us, t in timed}))
            print(f"{name:8s} rows {rows:4d}: default {default_us:7.2f} us, served {served_us:7.2f} us, "
                  f"best {best_us:7.2f} us at {best} "
                  f"(tile and splits; floor {1e6 * weight_bytes / bandwidth:.2f})", flush=True)
            del calls
            torch.cuda.empty_cache()
    return results


def markdown(result: dict) -> str:
    labels = list(dict.fromkeys(label for row in result["rows"] for label in row["runs"]))
    lines = [f"# small_linear: one-pass vs split-K vs GEMV ({result['device_name']}, bf16)", "",
             f"Copy bandwidth {result['copy_gb_s']:.0f} GB/s (measured in this run; the floor is weight bytes over "
             f"it). Cells: us per call (programs, weight GB/s), each a CUDA graph of {CALLS_PER_GRAPH} calls over "
             "weight copies that do not fit in L2.", "",
             "| layer | rows | W MB | floor us | " + " | ".join(labels) + " |",
             "|---|---:|---:|---:|" + "---:|" * len(labels)]
    for row in result["rows"]:
        runs = row["runs"]
        cells = [f"{runs[label]['us']:.2f} ({runs[label]['programs']}, {runs[label]['gb_s']:.0f})" if label in runs
                 else "-" for label in labels]
        lines.append(f"| {row['layer']} | {row['rows']} | {row['weight_mb']:.1f} | {row['floor_us']:.2f} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,8,16,64,128", help="rows per call (a frame step has batch or 2x)")
    parser.add_argument("--targets", default=str(small_linear_module.TARGET_PROGRAMS),
                        help="TARGET_PROGRAMS values to time the split plan at (comma list)")
    parser.add_argument("--gemv-programs", default=str(small_linear_module.GEMV_MIN_PROGRAMS),
                        help="GEMV_MIN_PROGRAMS values to time the GEMV at (comma list)")
    parser.add_argument("--sweep-tiles", action="store_true",
                        help="instead: the MMA kernel's tiles (TILES) per layer and row count, best vs default")
    parser.add_argument("--layers", default=",".join(LAYERS), help="--sweep-tiles: the layers (comma list)")
    parser.add_argument("--deep", action="store_true",
                        help="--sweep-tiles: the deep-pipeline tiles (DEEP_TILES) instead of TILES")
    parser.add_argument("--splits", default="1",
                        help="--sweep-tiles: K splits to try (comma list; past 1 with the SPLIT_TILES tiles)")
    parser.add_argument("--out-dir", default=".")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU (the kernels' timings are the point)")
    device = torch.device("cuda")
    bandwidth, _ = measure_ceilings(device)
    if args.sweep_tiles:
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        layers = args.layers.split(",")
        unknown = sorted(set(layers) - set(LAYERS))
        if unknown:
            parser.error(f"--layers: unknown {', '.join(unknown)} (known: {', '.join(LAYERS)})")
        swept = sweep_tiles([int(r) for r in args.rows.split(",")], bandwidth, layers,
                            [int(k) for k in args.splits.split(",")], DEEP_TILES if args.deep else TILES)
        (out / "small_linear_tiles.json").write_text(json.dumps(dict(
            device_name=torch.cuda.get_device_name(), copy_gb_s=bandwidth / 1e9, rows=swept), indent=2) + "\n")
        return
    rows = bench([int(r) for r in args.rows.split(",")], [int(t) for t in args.targets.split(",")],
                 [int(p) for p in args.gemv_programs.split(",")], bandwidth)
    result = dict(device_name=torch.cuda.get_device_name(), copy_gb_s=bandwidth / 1e9, torch=torch.__version__,
                  triton=triton.__version__, rows=rows)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "small_linear_bench.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "small_linear_bench.md").write_text(markdown(result))
    print(markdown(result))
    print(f"wrote {out / 'small_linear_bench.json'} and {out / 'small_linear_bench.md'}")


if __name__ == "__main__":
    main()
