"""SnakeBeta, the vocoder's activation, in one launch: ``x + sin(x * e^alpha)^2 / (e^beta + 1e-9)`` per channel of
x [B, C, T] (alpha, beta [C] in log scale), one read of x and one write of the output.

The torch path (``models.code2wav.vocoder.SnakeBeta``) is five to six elementwise launches (exp, mul, sin, pow,
mul, add), each reading and writing the whole tensor, at 29 call sites a decode: elementwise kernels, mostly these,
are about half of a stateful call's GPU time at full size on an H200 (batch 8 x 25 frames: ~7 of ~15 ms).

Rounding: the kernel computes in fp32 from x's and the parameters' values (e^alpha and 1 / (e^beta + 1e-9) once
per program, i.e. per channel and block of T) and rounds once, to x's dtype, at the end. The torch path rounds
after every op to the activation dtype: in bf16, e^alpha, the reciprocal, x * e^alpha, the sine, its square, the
product and the sum each to 8 significant bits, so its result is a few bf16 steps from the exact value where the
kernel's is within half a step (plus fp32's error). In fp32 the two differ by a few fp32 ulps. On the GPU
``tl.sin`` may be the hardware's approximation (absolute error ~1e-6 over |x e^alpha| < 100 pi), far below a bf16
step and within the tests' fp32 tolerance.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from omni_triton.kernels.dependent_launch import enabled_for, wait_for_previous

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_BLOCK = 1024  # elements of T a program: 8 bf16 (one 16-byte load) a thread at 4 warps


@triton.jit
def _snake_beta_kernel(x_ptr, alpha_ptr, beta_ptr, out_ptr, channels, length, stride_b, stride_c, stride_t,
                       BLOCK: tl.constexpr, PDL: tl.constexpr):
    row = tl.program_id(0)  # b * channels + c: unbounded grid axis (B * C passes 65535 at full width)
    channel = row % channels
    # the channel's constants (weights: may be read before the wait), in fp32
    scale = tl.exp(tl.load(alpha_ptr + channel).to(tl.float32))
    inverse = 1.0 / (tl.exp(tl.load(beta_ptr + channel).to(tl.float32)) + 1e-9)
    wait_for_previous(PDL)
    t = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = t < length
    x_row = x_ptr + (row // channels).to(tl.int64) * stride_b + channel.to(tl.int64) * stride_c
    x = tl.load(x_row + t * stride_t, mask=mask, other=0.0).to(tl.float32)
    sine = tl.sin(x * scale)
    out = x + inverse * sine * sine
    tl.store(out_ptr + row.to(tl.int64) * length + t, out.to(out_ptr.dtype.element_ty), mask=mask)


def snake_beta(x: torch.Tensor, alpha: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """x [B, C, T] (float32, float16 or bfloat16; any strides: the decoder's inputs are often views, e.g. a
    transposed conv's trimmed output), alpha and beta [C] (log scale, any float dtype, on x's device) ->
    ``x + sin(x * e^alpha)^2 / (e^beta + 1e-9)``, contiguous, in x's dtype. Raises ValueError naming the
    argument that does not fit."""
    if x.dim() != 3:
        raise ValueError(f"snake_beta x must be [B, C, T], got shape {tuple(x.shape)}")
    if x.dtype not in DTYPES:
        raise ValueError(f"snake_beta x must be one of {DTYPES}, got {x.dtype}")
    batch, channels, length = x.shape
    for name, parameter in (("alpha", alpha), ("beta", beta)):
        if tuple(parameter.shape) != (channels,) or not parameter.is_floating_point():
            raise ValueError(f"snake_beta {name} must be a float [C={channels}] tensor, got {parameter.dtype} "
                             f"{tuple(parameter.shape)}")
        if parameter.device != x.device:
            raise ValueError(f"snake_beta {name} is on {parameter.device}, x on {x.device}")
    out = torch.empty(batch, channels, length, dtype=x.dtype, device=x.device)
    if out.numel():
        block = min(MAX_BLOCK, max(128, triton.next_power_of_2(length)))
        pdl = enabled_for(x)
        # the kernel reads the constants densely: a module's parameters are already, a strided view is copied
        _snake_beta_kernel[(batch * channels, triton.cdiv(length, block))](
            x, alpha.contiguous(), beta.contiguous(), out, channels, length, x.stride(0), x.stride(1), x.stride(2),
            BLOCK=block, num_warps=max(1, block // 256), PDL=pdl, launch_pdl=pdl)
    return out
