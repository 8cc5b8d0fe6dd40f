"""Temperature, top-k, top-p and a seeded draw for rows of a small vocabulary, one program per row.

For the talker (3072 codec ids) and its code predictor (2048 per codebook), which sample 16 times per frame
inside one CUDA graph: one launch replaces the ~25 of the torch formulation (``engine.sampling.
DeviceSampler``), and draws the same tokens: candidates sorted by value (ties: lower id first), the first k
kept, then the shortest prefix whose mass reaches top_p, then an exponential race over uniforms keyed by
(seed + group, rank) exactly as ``kernels.random.uniform_rows`` draws them. Rows with temperature 0 take the
argmax. The sort carries each id in the low word of a 64-bit key whose high word is the value's bits mapped
to an order-preserving integer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from omni_triton.kernels.dependent_launch import enabled_for, wait_for_previous

MAX_VOCAB = 4096  # one row in one program's registers


@triton.jit
def _sample_rows_kernel(logits_ptr, stride_logits, vocab, temperature_ptr, top_k_ptr, top_p_ptr, seeds_ptr, group,
                        out_ptr, BLOCK_V: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    row = tl.program_id(0)
    ranks = tl.arange(0, BLOCK_V)
    logits = tl.load(logits_ptr + row * stride_logits + ranks, mask=ranks < vocab,
                     other=float("-inf")).to(tl.float32)
    temperature = tl.load(temperature_ptr + row)
    top_k = tl.load(top_k_ptr + row)
    top_p = tl.load(top_p_ptr + row)
    seed = tl.load(seeds_ptr + row) + group
    greedy = tl.argmax(logits, axis=0)
    scaled = (logits - tl.max(logits, axis=0)) / tl.where(temperature > 0, temperature, 1.0)
    bits = scaled.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # negative floats: flip the magnitude bits
    keys = (ordered.to(tl.int64) << 32) | (BLOCK_V - 1 - ranks).to(tl.int64)
    keys = tl.sort(keys, descending=True)
    ids = (BLOCK_V - 1) - (keys & 0xFFFFFFFF).to(tl.int32)
    ordered = (keys >> 32).to(tl.int32)
    values = tl.where(ordered >= 0, ordered, ordered ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)
    values = tl.where((top_k > 0) & (ranks >= top_k), float("-inf"), values)
    probs = tl.exp(values - tl.max(values, axis=0))
    probs = probs / tl.sum(probs, axis=0)
    probs = tl.where(tl.cumsum(probs, axis=0) - probs < top_p, probs, 0.0)
    race = probs / -tl.log(tl.rand(seed, ranks))
    sampled = tl.sum(tl.where(ranks == tl.argmax(race, axis=0), ids, 0), axis=0)
    tl.store(out_ptr + row, tl.where(temperature > 0, sampled, greedy).to(tl.int64))


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                seeds: torch.Tensor, group: int = 0) -> torch.Tensor:
    """logits [B, V <= MAX_VOCAB] float32, per-row controls [B] -> ids [B] int64."""
    num_rows, vocab = logits.shape
    if vocab > MAX_VOCAB or logits.stride(1) != 1:
        raise ValueError(f"sample_rows takes at most {MAX_VOCAB} contiguous logits per row, got {vocab}")
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows:
        pdl = enabled_for(logits)
        _sample_rows_kernel[(num_rows,)](logits, logits.stride(0), vocab, temperature, top_k, top_p, seeds, group, out,
                                         BLOCK_V=triton.next_power_of_2(vocab), num_warps=8, PDL=pdl, launch_pdl=pdl)
    return out
