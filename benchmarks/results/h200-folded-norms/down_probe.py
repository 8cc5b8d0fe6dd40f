"""The folded layer's gate/up -> down piece at 8-128 rows, us per call under a CUDA graph of 50 calls."""
import sys, torch, torch.nn.functional as F
sys.path.insert(0, "benchmarks")
from engine_microbench import graph_seconds_per_call
from omni_triton.kernels.activation import silu_and_mul
from omni_triton.kernels.dependent_launch import set_dependent_launch
from omni_triton.kernels.small_linear import small_linear
set_dependent_launch(True)
dev = "cuda"
g = torch.Generator(device=dev).manual_seed(0)
hidden, inter = 1024, 3072
W_gu = (torch.randn(2 * inter, hidden, device=dev, generator=g) / 32).bfloat16()
W_d = (torch.randn(hidden, inter, device=dev, generator=g) / 55).bfloat16()
W_o = (torch.randn(hidden, 2048, device=dev, generator=g) / 45).bfloat16()
norm_w = torch.ones(hidden, device=dev, dtype=torch.bfloat16)
from omni_triton.kernels.norm import rms_norm
for rows in [int(r) for r in sys.argv[1].split(",")]:
    x = torch.randn(rows, hidden, device=dev, generator=g).bfloat16()
    att = torch.randn(rows, 2048, device=dev, generator=g).bfloat16()
    _, sq = small_linear(att, W_o, residual=x, row_squares=True)
    gu = x.repeat(1, 6)
    variants = {
        "o+norm+gu+silu+down": lambda: small_linear(silu_and_mul(F.linear(rms_norm(small_linear(att, W_o, residual=x), norm_w, 1e-6), W_gu)), W_d, residual=x),
        "o_sq+gu+silu_r+down": lambda: small_linear(silu_and_mul(F.linear(small_linear(att, W_o, residual=x, row_squares=True)[0], W_gu), input_norm=(sq, hidden, 1e-6)), W_d, residual=x),
        "o": lambda: small_linear(att, W_o, residual=x),
        "o_sq": lambda: small_linear(att, W_o, residual=x, row_squares=True),
        "silu+down": lambda: small_linear(silu_and_mul(gu), W_d, residual=x),
        "silu_r+down": lambda: small_linear(silu_and_mul(gu, input_norm=(sq, hidden, 1e-6)), W_d, residual=x),
        "down_act": lambda: small_linear(gu, W_d, residual=x, activated_input=True, input_norm=(sq, hidden, 1e-6)),
    }
    bm = min(64, max(16, 1 << (rows - 1).bit_length()))
    for tile in [(bm, 16, 64, 4, 4), (bm, 16, 64, 8, 4), (bm, 16, 128, 8, 3), (bm, 32, 64, 8, 3), (bm, 16, 32, 4, 6)]:
        variants[f"down_act{tile}"] = (lambda t=tile: small_linear(gu, W_d, residual=x, activated_input=True,
                                                                  input_norm=(sq, hidden, 1e-6), tile=t))
    line = []
    for name, fn in variants.items():
        try:
            us = 1e6 * graph_seconds_per_call(lambda: [fn() for _ in range(50)], 50)
        except Exception as e:  # noqa
            us = float("nan"); print(name, "failed:", repr(e)[:200])
        line.append(f"{name} {us:.2f}")
    print(f"rows {rows}: " + " | ".join(line), flush=True)
