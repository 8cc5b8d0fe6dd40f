"""One call each of the predictor's 64-row GEMMs between cudaProfilerStart/Stop, for ncu."""
import torch, torch.nn.functional as F
from omni_triton.kernels.dependent_launch import set_dependent_launch
from omni_triton.kernels.small_linear import small_linear
set_dependent_launch(False)  # one kernel at a time under ncu
dev = "cuda"
g = torch.Generator(device=dev).manual_seed(0)
rows = 64
x = torch.randn(rows, 1024, device=dev, generator=g).bfloat16()
att = torch.randn(rows, 2048, device=dev, generator=g).bfloat16()
h = torch.randn(rows, 3072, device=dev, generator=g).bfloat16()
W = {name: (torch.randn(n, k, device=dev, generator=g) / k ** 0.5).bfloat16()
     for name, n, k in (("qkv", 4096, 1024), ("gate_up", 6144, 1024), ("o", 1024, 2048), ("down", 1024, 3072))}
calls = [lambda: F.linear(x, W["qkv"]), lambda: F.linear(x, W["gate_up"]),
         lambda: small_linear(att, W["o"], residual=x), lambda: small_linear(h, W["down"], residual=x)]
for c in calls:
    c(); c()
torch.cuda.synchronize()
torch.cuda.profiler.start()
for c in calls:
    c()
torch.cuda.synchronize()
torch.cuda.profiler.stop()
