"""Two-pass split-K (partials, then a reduce launch) vs the served launches, predictor shapes at 64 and 128 rows."""
import sys, torch
sys.path.insert(0, "benchmarks")
from engine_microbench import graph_seconds_per_call
from omni_triton.kernels.small_linear import small_linear
from omni_triton.kernels.norm import rms_norm
dev, dt = torch.device("cuda"), torch.bfloat16
L2 = torch.cuda.get_device_properties(0).L2_cache_size
CAND = {
    "o": [(64, 128, 256, 8), (64, 64, 256, 8), (64, 64, 128, 16), (64, 32, 256, 8), (64, 128, 128, 16), (64, 32, 128, 16)],
    "down": [(64, 128, 256, 12), (64, 64, 256, 12), (64, 64, 128, 24), (64, 32, 256, 12), (64, 128, 128, 24), (64, 64, 512, 6)],
    "qkv": [(64, 128, 256, 4), (64, 64, 256, 4), (64, 128, 128, 8), (64, 256, 256, 4), (64, 64, 128, 8)],
    "gate_up": [(64, 64, 256, 4), (64, 128, 256, 4), (64, 64, 128, 8), (64, 32, 256, 4)],
}
for rows in (64, 128):
    for name, K, N in (("o", 2048, 1024), ("down", 3072, 1024), ("qkv", 1024, 4096), ("gate_up", 1024, 3072)):
        gated = name == "gate_up"
        WN = 2 * N if gated else N
        copies = max(1, min(64, -(-4 * L2 // (WN * K * 2))))
        ws = [torch.randn(WN, K, device=dev, dtype=dt) / K ** .5 for _ in range(copies)]
        x = torch.randn(rows, K, device=dev, dtype=dt)
        g = torch.ones(K, device=dev, dtype=dt)
        res = {}
        if name in ("o", "down"):
            r = torch.randn(rows, N, device=dev, dtype=dt)
            served = lambda i: small_linear(x, ws[i % copies], residual=r, gemv=True, cublas=True)
            two = lambda i, t, sk: small_linear(x, ws[i % copies], residual=r, split_k=sk, tile=t, two_pass=True)
        else:
            served = lambda i: small_linear(x, ws[i % copies], norm_weight=g, eps=1e-6, gated=gated, gemv=True, cublas=True)
            # the norm as its own launch, then the two-pass GEMM (gate: SiLU in the reduce)
            two = lambda i, t, sk: small_linear(rms_norm(x, g, 1e-6), ws[i % copies], gated=gated, split_k=sk, tile=t, two_pass=True)
        ref = served(0)
        res["served"] = graph_seconds_per_call(lambda: [served(i) for i in range(64)], 64)
        for bm, bn, bk, sk in CAND[name]:
            t = (min(bm, rows), bn, bk, 4, 2)
            try:
                out = two(0, t, sk)
                err = (out.float() - ref.float()).abs().max().item()
                us = graph_seconds_per_call(lambda: [two(i, t, sk) for i in range(64)], 64)
                res[f"{bn}x{bk}s{sk}"] = us
                if err > 0.1:
                    print("  big err", name, t, sk, err)
            except Exception as e:
                print("  fail", name, t, sk, str(e)[:160])
        print(f"{name:8s} rows {rows}: " + "  ".join(f"{k} {v*1e6:.2f}" for k, v in res.items()), flush=True)
        ws = None  # freed before the next shape
        torch.cuda.empty_cache()
