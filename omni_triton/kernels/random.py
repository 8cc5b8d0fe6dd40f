"""Counter-based uniforms with one seed per row: what seeded sampling on the GPU draws from.

``uniform_rows(seeds, n)[i, j]`` is Philox of (seeds[i], j): it depends on the row's own seed and on
nothing else (not the batch, not other rows, not the launch), so a request's draws are reproducible under
any batch composition, inside a CUDA graph as well (the seeds are a device tensor the host refills).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from omni_triton.kernels.dependent_launch import enabled_for, wait_for_previous


@triton.jit
def _uniform_rows_kernel(seeds_ptr, out_ptr, n_cols, stride_out, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    seed = tl.load(seeds_ptr + row)
    tl.store(out_ptr + row * stride_out + cols, tl.rand(seed, cols), mask=cols < n_cols)


def uniform_rows(seeds: torch.Tensor, n_cols: int) -> torch.Tensor:
    """seeds [B] int64 -> [B, n_cols] float32 uniforms in [0, 1)."""
    out = torch.empty(seeds.shape[0], n_cols, dtype=torch.float32, device=seeds.device)
    block = min(1024, triton.next_power_of_2(n_cols))
    if seeds.shape[0]:
        pdl = enabled_for(seeds)
        _uniform_rows_kernel[(seeds.shape[0], triton.cdiv(n_cols, block))](seeds, out, n_cols, out.stride(0),
                                                                           BLOCK=block, num_warps=4, PDL=pdl,
                                                                           launch_pdl=pdl)
    return out
