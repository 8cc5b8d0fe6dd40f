"""Probe: split-K whose partials are summed by all of a tile's programs after an in-tile barrier (deterministic:
split order; no serial last-program tail), against small_linear, for the predictor's o/down at 16-128 rows."""
import sys, torch, triton, triton.language as tl
sys.path.insert(0, "benchmarks")
from engine_microbench import graph_seconds_per_call
from omni_triton.kernels.dependent_launch import set_dependent_launch
from omni_triton.kernels.small_linear import small_linear


@triton.jit
def coop_kernel(x_ptr, w_ptr, out_ptr, res_ptr, part_ptr, arrive_ptr, depart_ptr, M, N, K, k_per_split,
                stride_xm, stride_wn, stride_om, stride_rm,
                SPLITS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ROWS: tl.constexpr):
    pid_n, pid_m, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    row_mask, col_mask = rows < M, cols < N
    ks = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    k_start = split * k_per_split
    for k0 in range(k_start, tl.minimum(K, k_start + k_per_split), BK):
        kk = k0 + ks
        a = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + kk[None, :],
                    mask=row_mask[:, None] & (kk < K)[None, :], other=0.0)
        w = tl.load(w_ptr + cols[None, :].to(tl.int64) * stride_wn + kk[:, None],
                    mask=(kk < K)[:, None] & col_mask[None, :], other=0.0)
        acc = tl.dot(a, w, acc)
    tile = pid_m * tl.num_programs(0) + pid_n
    at = rows[:, None].to(tl.int64) * N + cols[None, :]
    tl.store(part_ptr + split * M * N + at, acc, mask=row_mask[:, None] & col_mask[None, :], cache_modifier=".cg")
    tl.debug_barrier()
    tl.atomic_add(arrive_ptr + tile, 1, sem="release")
    while tl.atomic_add(arrive_ptr + tile, 0, sem="acquire") < SPLITS:
        pass
    mine = pid_m * BM + split * ROWS + tl.arange(0, ROWS)
    mine_mask = (mine < M)[:, None] & col_mask[None, :]
    mine_at = mine[:, None].to(tl.int64) * N + cols[None, :]
    total = tl.zeros([ROWS, BN], dtype=tl.float32)
    for t in tl.static_range(SPLITS):
        total += tl.load(part_ptr + t * M * N + mine_at, mask=mine_mask, other=0.0, cache_modifier=".cg")
    dtype = x_ptr.dtype.element_ty
    residual = tl.load(res_ptr + mine[:, None].to(tl.int64) * stride_rm + cols[None, :], mask=mine_mask, other=0.0)
    out = (total.to(dtype).to(tl.float32) + residual.to(tl.float32)).to(dtype)
    tl.store(out_ptr + mine[:, None].to(tl.int64) * stride_om + cols[None, :], out, mask=mine_mask)
    if tl.atomic_add(depart_ptr + tile, 1, sem="acq_rel") == SPLITS - 1:
        tl.store(arrive_ptr + tile, 0)
        tl.store(depart_ptr + tile, 0)


def coop_linear(x, w, residual, bn, splits, bk, stages, warps):
    M, K = x.shape
    N = w.shape[0]
    bm = min(64, max(16, triton.next_power_of_2(M)))
    assert bm % splits == 0
    steps = triton.cdiv(K, bk)
    k_per_split = triton.cdiv(steps, splits) * bk
    grid = (triton.cdiv(N, bn), triton.cdiv(M, bm), splits)
    key = (M, N, splits)
    if key not in SCRATCH:
        SCRATCH[key] = (torch.empty(splits * M * N, device=x.device, dtype=torch.float32),
                        torch.zeros(grid[0] * grid[1], device=x.device, dtype=torch.int32),
                        torch.zeros(grid[0] * grid[1], device=x.device, dtype=torch.int32))
    part, arrive, depart = SCRATCH[key]
    out = torch.empty(M, N, device=x.device, dtype=x.dtype)
    coop_kernel[grid](x, w, out, residual, part, arrive, depart, M, N, K, k_per_split, x.stride(0), w.stride(0),
                      out.stride(0), residual.stride(0), SPLITS=splits, BM=bm, BN=bn, BK=bk, ROWS=bm // splits,
                      num_warps=warps, num_stages=stages)
    return out


SCRATCH = {}
dev = "cuda"
g = torch.Generator(device=dev).manual_seed(0)
CONFIGS = [(16, 2, 256, 3, 4), (32, 4, 128, 3, 4), (64, 4, 128, 3, 4), (32, 8, 128, 3, 4), (64, 8, 128, 3, 4),
           (64, 8, 64, 4, 4), (128, 8, 128, 2, 4), (64, 16, 64, 3, 4), (32, 16, 64, 3, 4)]
for rows in [int(r) for r in sys.argv[1].split(",")]:
    for name, K in (("o", 2048), ("down", 3072)):
        x = torch.randn(rows, K, device=dev, generator=g).bfloat16()
        w = (torch.randn(1024, K, device=dev, generator=g) / K ** 0.5).bfloat16()
        res = torch.randn(rows, 1024, device=dev, generator=g).bfloat16()
        want = small_linear(x, w, residual=res)
        line = []
        for pdl in (True, False):
            set_dependent_launch(pdl)
            us = 1e6 * graph_seconds_per_call(lambda: [small_linear(x, w, residual=res) for _ in range(50)], 50)
            line.append(f"small_linear{' pdl' if pdl else ''} {us:.2f}")
        set_dependent_launch(True)
        for cfg in CONFIGS:
            bm = min(64, max(16, triton.next_power_of_2(rows)))
            if bm % cfg[1]:
                continue
            try:
                got = coop_linear(x, w, res, *cfg)
                err = float((got.float() - want.float()).norm() / want.float().norm())
                again = coop_linear(x, w, res, *cfg)
                us = 1e6 * graph_seconds_per_call(lambda: [coop_linear(x, w, res, *cfg) for _ in range(50)], 50)
                line.append(f"coop{cfg} {us:.2f} (err {err:.1e}{'' if torch.equal(got, again) else ' NONDET'})")
            except Exception as e:  # noqa: BLE001
                line.append(f"coop{cfg} failed {type(e).__name__}: {str(e)[:120]}")
        print(f"{name} rows {rows}: " + " | ".join(line), flush=True)
