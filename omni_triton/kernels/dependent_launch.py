"""Programmatic dependent launch (PDL, Hopper and later): the next kernel starts before this one ends.

A decode step is a chain of ~1,000 small kernels (a batch-1 talker frame), each a few microseconds long, and
on a stream every kernel normally waits for the previous one to finish and flush before its first block even
launches: the launch, the first memory round trip and the tail of every kernel are paid one after the other.
Launched with PDL (``launch_pdl=True``), a kernel's blocks may start as soon as every block of the previous
kernel has started and said so (``gdc_launch_dependents``); each block then waits (``gdc_wait``) for the
previous kernel to have finished, with its writes visible, before it touches anything that kernel produced.

The contract every kernel here keeps (``wait_for_previous`` at its top, before any load of an activation and
before ANY store: a buffer it writes may be one the previous kernel still reads, handed back by the caching
allocator): only constant inputs (weights) are read before the wait. The weight-bound linears
(``kernels.small_linear``) use that window to pull their slice of W into L2 (``prefetch_l2``), so the next
layer's weight stream overlaps this one's. A kernel that is not launched with PDL, or a PDL kernel after a
torch kernel, behaves as before (the wait then returns at once); CUDA graphs keep the dependency as a
programmatic edge.

The switch (``set_dependent_launch``, ``EngineConfig.dependent_launch``) is process-wide and read at each
launch: a CUDA graph keeps what it captured. ``enabled_for`` is False off CUDA, before sm_90, and under
Triton's interpreter (which has no grid dependency control), so kernels pass ``PDL=False`` there.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

_enabled = True
# Triton reads it when a kernel is defined, so it cannot change under a running process; read it once.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def set_dependent_launch(enabled: bool) -> None:
    global _enabled
    _enabled = bool(enabled)


def dependent_launch_on() -> bool:
    return _enabled


@functools.lru_cache(maxsize=None)
def _sm90(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def hopper_or_later(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` lives on a GPU of compute capability 9.0 or later (PDL, TMA descriptors)."""
    return tensor.is_cuda and _sm90(tensor.device.index if tensor.device.index is not None
                                    else torch.cuda.current_device())


def enabled_for(tensor: torch.Tensor) -> bool:
    """Whether kernels reading ``tensor`` launch with PDL (their ``PDL`` argument and ``launch_pdl=``)."""
    return _enabled and not INTERPRETED and hopper_or_later(tensor)


@triton.jit
def wait_for_previous(PDL: tl.constexpr):
    """Wait for the previous kernel's writes, then let the next kernel start launching (after the wait, not
    before: at most two kernels of the chain hold SM resources at once)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


L2_LINE_BYTES = 128


def prefetch_lines(depth: int, element_size: int) -> int:
    """L2 lines of a ``depth``-element row, rounded up to a power of two (the prefetch tile's width)."""
    return triton.next_power_of_2(triton.cdiv(depth * element_size, L2_LINE_BYTES))


@triton.jit
def prefetch_l2(ptrs, mask, fallback, PDL: tl.constexpr):
    """Ask L2 for the lines ``ptrs`` point into (masked-off ones prefetch ``fallback``, a valid address, instead):
    no registers held, no result to wait for. Only under PDL, before ``wait_for_previous``: that is the window
    it fills."""
    if PDL:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n mov.u32 $0, 0;", "=r,l", [tl.where(mask, ptrs, fallback)],
                                  dtype=tl.int32, is_pure=False, pack=1)
