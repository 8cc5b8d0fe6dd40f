"""Where a predictor GEMM's ~5 us goes: weights hot in L2 vs cold; empty PDL kernel chain; K-scaling."""
import sys, torch, triton, triton.language as tl
sys.path.insert(0, "benchmarks")
import torch.nn.functional as F
from engine_microbench import graph_seconds_per_call
from omni_triton.kernels.small_linear import small_linear
from omni_triton.kernels.dependent_launch import wait_for_previous
dev, dt = torch.device("cuda"), torch.bfloat16
L2 = torch.cuda.get_device_properties(0).L2_cache_size
print("L2", L2 / 2**20, "MB", torch.cuda.get_device_properties(0).multi_processor_count, "SMs")

@triton.jit
def _empty(out_ptr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    tl.store(out_ptr + tl.program_id(0), 1)

@triton.jit
def _read(x_ptr, out_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr + tl.program_id(0), tl.sum(v.to(tl.float32), axis=0))

out = torch.zeros(1024, device=dev)
for pdl in (False, True):
    for grid in (1, 64, 132, 512):
        s = graph_seconds_per_call(lambda: [_empty[(grid,)](out, PDL=pdl, launch_pdl=pdl) for _ in range(64)], 64)
        print(f"empty kernel grid {grid:4d} pdl {pdl}: {s*1e6:.2f} us", flush=True)
buf = torch.randn(64 * 1024 * 1024 // 2, device=dev, dtype=dt)
for mb in (0.25, 4, 16):
    n = int(mb * 2**20 / 2)
    blocks = triton.cdiv(n, 8192)
    s = graph_seconds_per_call(lambda: [_read[(blocks,)](buf, out, n, BLOCK=8192, PDL=True, launch_pdl=True, num_warps=8) for _ in range(64)], 64)
    print(f"read {mb} MB hot, {blocks} programs, pdl: {s*1e6:.2f} us", flush=True)
for name, K, N in (("o", 2048, 1024), ("down", 3072, 1024), ("qkv", 1024, 4096), ("gate_up", 1024, 6144)):
    for copies_mode in ("hot", "cold"):
        copies = 1 if copies_mode == "hot" else max(1, min(64, -(-4 * L2 // (N * K * 2))))
        ws = [torch.randn(N, K, device=dev, dtype=dt) / K ** .5 for _ in range(copies)]
        x = torch.randn(64, K, device=dev, dtype=dt)
        r = torch.randn(64, N, device=dev, dtype=dt)
        res = {}
        res["cublas"] = graph_seconds_per_call(lambda: [F.linear(x, ws[i % copies]) for i in range(64)], 64)
        if N == 1024:
            res["small_linear"] = graph_seconds_per_call(lambda: [small_linear(x, ws[i % copies], residual=r) for i in range(64)], 64)
            for sk in (2, 4, 8):
                for tile in ((64, 64, 128, 4, 3), (64, 32, 256, 4, 3), (64, 128, 128, 4, 3)):
                    try:
                        res[f"sl s{sk} {tile[1]}x{tile[2]}"] = graph_seconds_per_call(lambda: [small_linear(x, ws[i % copies], residual=r, split_k=sk, tile=tile) for i in range(64)], 64)
                    except Exception as e:
                        print("fail", sk, tile, str(e)[:100])
        print(f"{name:8s} 64 rows {copies_mode}: " + "  ".join(f"{k} {v*1e6:.2f}" for k, v in res.items()), flush=True)
        ws = None  # freed before the next shape
        torch.cuda.empty_cache()
