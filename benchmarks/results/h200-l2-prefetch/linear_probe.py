"""o/down at 64/128 rows: small_linear (served) vs cuBLAS addmm_ in place (one launch, one rounding) vs linear+add."""
import sys, torch
sys.path.insert(0, "benchmarks")
import torch.nn.functional as F
from engine_microbench import graph_seconds_per_call
from omni_triton.kernels.small_linear import small_linear
dev, dt = torch.device("cuda"), torch.bfloat16
L2 = torch.cuda.get_device_properties(0).L2_cache_size
for name, K, N in (("o", 2048, 1024), ("down", 3072, 1024), ("qkv", 1024, 4096), ("gate_up", 1024, 6144)):
    for rows in (64, 128):
        copies = max(1, min(64, -(-4 * L2 // (N * K * 2))))
        ws = [torch.randn(N, K, device=dev, dtype=dt) / K ** .5 for _ in range(copies)]
        x = torch.randn(rows, K, device=dev, dtype=dt)
        r = torch.randn(rows, N, device=dev, dtype=dt)
        calls = 64
        res = {}
        if name in ("o", "down"):
            res["small_linear"] = graph_seconds_per_call(
                lambda: [small_linear(x, ws[i % copies], residual=r) for i in range(calls)], calls)
            res["addmm_"] = graph_seconds_per_call(lambda: [r.addmm_(x, ws[i % copies].t()) for i in range(calls)], calls)
            res["addmm"] = graph_seconds_per_call(lambda: [torch.addmm(r, x, ws[i % copies].t()) for i in range(calls)], calls)
        res["linear"] = graph_seconds_per_call(lambda: [F.linear(x, ws[i % copies]) for i in range(calls)], calls)
        res["linear+add"] = graph_seconds_per_call(lambda: [F.linear(x, ws[i % copies]).add_(r[:, :1]) for i in range(calls)], calls)
        floor = N * K * 2 / 4.0e12
        print(f"{name:8s} rows {rows:4d} floor@4TB/s {floor*1e6:5.2f} us  " +
              "  ".join(f"{k} {v*1e6:6.2f}" for k, v in res.items()), flush=True)
        ws = None  # freed before the next shape
        torch.cuda.empty_cache()
