"""Device buffers a kernel keeps from call to call: split-K partials and arrival tickets.

A kernel that splits its work over programs and lets the last one to arrive finish it (``small_linear``'s
split-K, ``paged_attention``'s split decode) needs scratch for the partial results and counters that start at 0
(the last program puts them back to 0). Made by the first call, which runs eagerly before any CUDA graph
captures the kernel, and kept, so every later call and graph replay reuses the same memory. Keyed by the
owning kernel as well as the size, so no two kernels share one. One stream at a time may use them (calls on a
stream are ordered; under programmatic dependent launch a kernel touches them only after its predecessor ended).
"""

from __future__ import annotations

import torch

_buffers: dict[tuple[str, torch.device, torch.dtype, int], torch.Tensor] = {}


def persistent_zeros(owner: str, device: torch.device, dtype: torch.dtype, numel: int) -> torch.Tensor:
    key = (owner, torch.device(device), dtype, numel)
    if key not in _buffers:
        # a normal tensor even when the first call runs under inference mode (an engine's step): a later caller
        # outside it may then still write to it (an inference tensor refuses in-place updates out of that mode)
        with torch.inference_mode(False):
            _buffers[key] = torch.zeros(numel, dtype=dtype, device=device)
    return _buffers[key]


def buffers_of(owner: str) -> list[torch.Tensor]:
    """Every buffer ``owner`` made so far (tests: counters back at 0, poisoned partials)."""
    return [buffer for (name, *_), buffer in _buffers.items() if name == owner]
