"""Probe: the talker frame at 64 rows with each MoE layer's first expert tiles (gate/up) prefetched into L2 at
the layer's start (one small PDL kernel that issues prefetch.global.L2 and ends)."""
import argparse, sys, torch, triton, triton.language as tl
sys.path.insert(0, "benchmarks")
import engine_microbench as mb
import step_exposure
from omni_triton.kernels.dependent_launch import enabled_for, wait_for_previous
from omni_triton.models.layers import decoder
from omni_triton.models.layers.moe import SparseMoE

@triton.jit
def _prefetch_kernel(w_ptr, stride_e, up_offset, elems, LINES: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        e = tl.program_id(0)
        base = w_ptr + e.to(tl.int64) * stride_e + tl.program_id(1) * up_offset
        offs = tl.arange(0, LINES) * 64  # 64 bf16 = 128 B
        ptrs = base + offs
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n mov.u32 $0, 0;", "=r,l",
                                  [tl.where(offs < elems, ptrs, base)], dtype=tl.int32, is_pure=False, pack=1)
    wait_for_previous(PDL)

ROWS = {"n": -1}
real_forward = decoder.DecoderLayer.forward

def forward(self, x, cos, sin, batch, residual=None):
    n = ROWS["n"]
    if n >= 0 and isinstance(self.mlp, SparseMoE) and x.is_cuda and x.shape[0] > 2:
        w = self.mlp.experts.gate_up_proj
        E, two_i, H = w.shape
        elems = n * H
        lines = max(16, triton.next_power_of_2(max(1, elems // 64)))
        pdl = enabled_for(x)
        _prefetch_kernel[(E, 2)](w, w.stride(0), (two_i // 2) * H, elems, LINES=lines, PDL=pdl,
                                 num_warps=8, launch_pdl=pdl)
    return real_forward(self, x, cos, sin, batch, residual)

decoder.DecoderLayer.forward = forward
parser = argparse.ArgumentParser()
parser.add_argument("--variants", default="-1,64,0,32,96,-1")
parser.add_argument("--batches", default="64")
a = parser.parse_args()
import types
from omni_triton.models.weights import load_talker
args = types.SimpleNamespace(device="cuda", dtype=torch.bfloat16, max_num_batched_tokens=2048, tag="x",
                             config_dir=mb.config_dir(mb.FULL_SIZE_CONFIG, 0), talker_prompt_len=128,
                             sampling="served", overlap_steps=True)
model = load_talker(args.config_dir, "cuda", args.dtype, load_format="dummy")
res = {}
for v in [int(v) for v in a.variants.split(",")]:
    ROWS["n"] = v
    for b in [int(b) for b in a.batches.split(",")]:
        args.tag = f"rows{v}"
        r = step_exposure.measure(args, "talker", model, b)
        res.setdefault((v, b), []).append(r["graph_gpu_p50_ms"])
for (v, b), t in sorted(res.items()):
    print(f"prefetch rows {v:3d} batch {b}: graph p50 " + " ".join(f"{x:.4f}" for x in t))
