"""Weights pulled into L2 ahead of the kernels that read them, by a kernel on a side stream.

The code predictor's 15 steps per frame are chains of small GEMMs (qkv 8 MB, o 4, gate/up 12.6, down 6.3 at the
released size), each reading its weights from HBM with a few microseconds of latency in front (measured on an
H200: 5-7.5 us a call at 64 rows against 1-3 us of bandwidth), while between them the attention, the norms and the
activation leave HBM idle. ``prefetch_to_l2`` asks L2 for every line of some weight tensors in one launch that
only issues requests (``prefetch.global.L2``: no registers held, nothing waited for), so run beside the chain (a
``models.layers.side_stream.SideBranch``) it fetches the next GEMMs' weights while the current ones run and they
then read them from L2. Nothing is computed or written: results are the same bits with it or without it.

CUDA only, sm_80 and later; elsewhere (the CPU path, Triton's interpreter, which runs no inline assembly) it does
nothing.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from omni_triton.kernels.dependent_launch import L2_LINE_BYTES

MAX_TENSORS = 6  # weight tensors per launch (a predictor layer's o, gate/up, down, the next qkv, an lm_head)
# 128 KB a program (8 lines a thread): a 12.6 MB tensor is ~100 programs, a predictor layer's four ~250; few
# enough that the side stream's launch leaves the chain's kernels their SMs
LINES_PER_PROGRAM = 1024


@triton.jit
def _prefetch_kernel(ptr0, lines0, ptr1, lines1, ptr2, lines2, ptr3, lines3, ptr4, lines4, ptr5, lines5,
                     LINES: tl.constexpr, LINE_BYTES: tl.constexpr):
    """Program (i, t): lines [i * LINES, (i + 1) * LINES) of tensor t (lines past its end not asked)."""
    which = tl.program_id(1)
    byte: tl.constexpr = tl.pointer_type(tl.uint8)
    base, count = ptr0.to(byte), lines0
    if which == 1:
        base, count = ptr1.to(byte), lines1
    elif which == 2:
        base, count = ptr2.to(byte), lines2
    elif which == 3:
        base, count = ptr3.to(byte), lines3
    elif which == 4:
        base, count = ptr4.to(byte), lines4
    elif which == 5:
        base, count = ptr5.to(byte), lines5
    lines = tl.program_id(0) * LINES + tl.arange(0, LINES)
    mask = lines < count
    ptrs = base + tl.where(mask, lines, 0).to(tl.int64) * LINE_BYTES
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@functools.lru_cache(maxsize=None)
def _supported(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 8


def prefetch_supported(like: torch.Tensor) -> bool:
    """Whether ``prefetch_to_l2`` issues anything for tensors like ``like`` (CUDA, sm_80+, not interpreted)."""
    from omni_triton.kernels.dependent_launch import _INTERPRETED

    if not like.is_cuda or _INTERPRETED:
        return False
    return _supported(like.device.index if like.device.index is not None else torch.cuda.current_device())


def line_counts(tensors: list[torch.Tensor]) -> list[int]:
    """L2 lines each tensor's storage spans from its first byte (what one launch asks for)."""
    return [triton.cdiv(t.numel() * t.element_size(), L2_LINE_BYTES) for t in tensors]


def prefetch_to_l2(tensors: list[torch.Tensor]) -> None:
    """Ask L2 for every line of up to ``MAX_TENSORS`` contiguous tensors (one launch; a no-op where
    ``prefetch_supported`` is False). Launch it on the stream that should run it: it orders nothing."""
    if not tensors:
        return
    if len(tensors) > MAX_TENSORS:
        raise ValueError(f"prefetch_to_l2 takes at most {MAX_TENSORS} tensors a launch, got {len(tensors)}")
    if any(not t.is_contiguous() for t in tensors):
        raise ValueError("prefetch_to_l2 needs contiguous tensors (it asks for the lines they span)")
    if not prefetch_supported(tensors[0]):
        return
    counts = line_counts(tensors)
    args = []
    for i in range(MAX_TENSORS):
        # unused slots: the first tensor with no lines
        args += [tensors[i], counts[i]] if i < len(tensors) else [tensors[0], 0]
    grid = (triton.cdiv(max(counts), LINES_PER_PROGRAM), len(tensors))
    _prefetch_kernel[grid](*args, LINES=LINES_PER_PROGRAM, LINE_BYTES=L2_LINE_BYTES, num_warps=4)
