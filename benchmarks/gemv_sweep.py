"""The multiply-add GEMV kernels at a decode step's one row, swept over their launch shape: columns per program
(``BLOCK_N``), K chunk (``BLOCK_K``) and warps, at the thinker's and the code predictor's shapes, against the
weight-read floor measured in the same run. The question: how far from HBM bandwidth is a batch-1 step's
largest kernel, and does another launch shape than the shipped one (``small_linear.gemv_launch``,
``fused_moe.pair_gemv_launch``: their tuned tables, else the rule with 4 warps) close it?

    python benchmarks/gemv_sweep.py --out-dir $OUT/gemv        # CUDA only; writes gemv_sweep.{json,md}

Each timing replays a CUDA graph of 64 calls launched as the engine launches them (programmatic dependent
launch, the weight slice prefetched into L2 before the wait) over enough weight copies, or, for the experts,
random expert ids over all 128 experts, that every call reads its weights from HBM.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton

from engine_microbench import graph_seconds_per_call, measure_ceilings
from omni_triton.kernels.dependent_launch import prefetch_lines
from omni_triton.kernels.fused_moe import (_down_weighted_gemv_kernel, _gate_up_silu_gemv_kernel,
                                          pair_gemv_launch)
from omni_triton.kernels.small_linear import _gemv_kernel, gemv_launch

CALLS = 64
MIN_BYTES = 256 << 20  # weight bytes a graph's calls cycle through (> 4x the L2)
# name -> (kind, K, N, extra): dense = small_linear's GEMV (x @ W.T); gate_up / down = the per-pair expert GEMVs
SHAPES = {
    "thinker qkv": ("dense", 2048, 5120, {}),
    "thinker o_proj": ("dense", 4096, 2048, {}),
    "thinker experts gate/up (8 pairs)": ("gate_up", 2048, 768, dict(experts=128, top_k=8)),
    "thinker experts down (8 pairs)": ("down", 768, 2048, dict(experts=128, top_k=8)),
    "predictor qkv (norm)": ("dense", 1024, 4096, dict(norm=True)),
    "predictor gate/up (norm, SiLU)": ("dense", 1024, 3072, dict(norm=True, gated=True)),
    "predictor down": ("dense", 3072, 1024, {}),
    "o_proj of the talker and the predictor": ("dense", 2048, 1024, {}),
    "talker qkv": ("dense", 1024, 2560, {}),
    "talker shared gate/up + router + gate (packed, padded to 8 rows)": ("dense", 1024, 1672, {}),
    "talker experts gate/up (6 pairs)": ("gate_up", 1024, 384, dict(experts=128, top_k=6)),
    "talker experts down (6 pairs)": ("down", 384, 1024, dict(experts=128, top_k=6)),
}
BLOCK_NS = (2, 4, 8, 16)
CHUNK_ELEMENTS = (2048, 4096, 8192)  # BLOCK_N x BLOCK_K: the weights one unrolled K step holds
WARPS = (4, 8)


def dense_launcher(depth: int, cols: int, norm: bool = False, gated: bool = False):
    device, dtype = torch.device("cuda"), torch.bfloat16
    rows_w = 2 * cols if gated else cols
    copies = max(1, -(-MIN_BYTES // (rows_w * depth * 2)))
    weights = [torch.randn(rows_w, depth, device=device, dtype=dtype) / depth ** 0.5 for _ in range(copies)]
    x = torch.randn(1, depth, device=device, dtype=dtype)
    out = torch.empty(1, cols, device=device, dtype=dtype)
    norm_weight = torch.ones(depth, device=device, dtype=dtype)

    def launch(i: int, block_n: int, block_k: int, warps: int) -> None:
        _gemv_kernel[(triton.cdiv(cols, block_n),)](
            x, weights[i % copies], out, norm_weight, out, 1, cols, x.stride(0), depth, out.stride(0), 0, 1e-6,
            K=depth, NORM=norm, GATED=gated, RESIDUAL=False, BLOCK_M=1, BLOCK_N=block_n, BLOCK_K=block_k, PDL=True,
            PREFETCH_LINES=prefetch_lines(depth, 2), num_warps=warps, launch_pdl=True)

    return launch, rows_w * depth * 2, gemv_launch(1, cols, depth, gated)[1:]


def expert_launcher(kind: str, depth: int, cols: int, experts: int, top_k: int):
    device, dtype = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = [torch.randperm(experts, generator=gen)[:top_k].to(device) for _ in range(CALLS)]
    if kind == "gate_up":
        weight = torch.randn(experts, 2 * cols, depth, device=device, dtype=dtype) / depth ** 0.5
        x = torch.randn(1, depth, device=device, dtype=dtype)
        out = torch.empty(top_k, cols, device=device, dtype=dtype)

        def launch(i: int, block_n: int, block_k: int, warps: int) -> None:
            _gate_up_silu_gemv_kernel[(triton.cdiv(cols, block_n), top_k)](
                x, weight, ids[i], out, cols, x.stride(0), weight.stride(0), weight.stride(1), out.stride(0),
                x, 0, 0, 0, K=depth, TOP_K=top_k, BLOCK_N=block_n, BLOCK_K=block_k, PDL=True, num_warps=warps, launch_pdl=True)

        return launch, top_k * 2 * cols * depth * 2, pair_gemv_launch("gate_up", top_k, cols, depth)
    weight = torch.randn(experts, cols, depth, device=device, dtype=dtype) / depth ** 0.5
    h = torch.randn(top_k, depth, device=device, dtype=dtype)
    pair_weights = torch.rand(top_k, device=device, dtype=torch.float32)
    out = torch.empty(top_k, cols, device=device, dtype=dtype)

    def launch(i: int, block_n: int, block_k: int, warps: int) -> None:
        _down_weighted_gemv_kernel[(triton.cdiv(cols, block_n), top_k)](
            h, weight, ids[i], pair_weights, out, cols, h.stride(0), weight.stride(0), weight.stride(1), out.stride(0),
            h, 0, 0, K=depth, BLOCK_N=block_n, BLOCK_K=block_k, PDL=True, num_warps=warps, launch_pdl=True)

    return launch, top_k * cols * depth * 2, pair_gemv_launch("down", top_k, cols, depth)


def seconds_per_call(launch, block_n: int, block_k: int, warps: int, repeat: int = 5) -> float:
    def issue_calls():
        for i in range(CALLS):
            launch(i, block_n, block_k, warps)

    return graph_seconds_per_call(issue_calls, CALLS, repeat)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", default=".")
    args = parser.parse_args()
    bandwidth, _ = measure_ceilings(torch.device("cuda"))
    read_rate = bandwidth  # HBM's rate, reads and writes together (the copy's bytes both ways): the floors' divisor
    results, lines = [], []
    for name, (kind, depth, cols, extra) in SHAPES.items():
        launch, weight_bytes, shipped = (dense_launcher(depth, cols, **extra) if kind == "dense"
                                         else expert_launcher(kind, depth, cols, **extra))
        floor_us = weight_bytes / read_rate * 1e6
        rows = []
        for block_n in BLOCK_NS:
            for chunk in CHUNK_ELEMENTS:
                block_k = min(triton.next_power_of_2(depth), chunk // block_n)
                for warps in WARPS:
                    us = seconds_per_call(launch, block_n, block_k, warps) * 1e6
                    rows.append(dict(shape=name, block_n=block_n, block_k=block_k, warps=warps, us=us,
                                     floor_us=floor_us, shipped=(block_n, block_k, warps) == tuple(shipped)))
        best = min(rows, key=lambda r: r["us"])
        ship = next((r for r in rows if r["shipped"]), None) or dict(
            us=seconds_per_call(launch, *shipped) * 1e6, block_n=shipped[0], block_k=shipped[1], warps=shipped[2])
        results.extend(rows)
        lines.append(f"| {name} | {weight_bytes / 2**20:.1f} | {floor_us:.2f} | {ship['us']:.2f} "
                     f"({ship['block_n']}, {ship['block_k']}, {ship['warps']}) | {best['us']:.2f} ({best['block_n']}, "
                     f"{best['block_k']}, {best['warps']}) | {ship['us'] / best['us']:.2f}x |")
        print(lines[-1], flush=True)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    head = (f"Device: {torch.cuda.get_device_name()}; weight read rate {read_rate / 1e9:.0f} GB/s (the copy "
            f"bandwidth measured in this run, reads and writes together). us per call at one row; (BLOCK_N, BLOCK_K, warps).\n\n"
            "| kernel | weight MiB | floor us | shipped | best of the sweep | shipped / best |\n"
            "|---|---:|---:|---:|---:|---:|\n")
    (out / "gemv_sweep.md").write_text(head + "\n".join(lines) + "\n")
    (out / "gemv_sweep.json").write_text(json.dumps(dict(read_rate=read_rate, results=results), indent=1))
    print(f"wrote {out / 'gemv_sweep.md'}")


if __name__ == "__main__":
    main()
