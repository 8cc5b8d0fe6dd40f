"""MoE routing on the GPU: the softmax top-k router, and the expert-sorted layout the grouped GEMMs read.

``expert_sorted_layout`` lists the (token, slot) pairs expert by expert, each expert's run padded to a
multiple of ``block_m``, so every ``block_m`` rows of the GEMM belong to one expert. It is one single-program
launch with no host sync and shapes that depend only on the number of tokens, so it is captured in CUDA
graphs as is. Up to ``SORT_MAX_PAIRS`` pairs (decode steps and short prefills: the talker's 64 rows are 384
pairs) the program sorts the (expert, pair) keys in registers and finds each run's first and last position by
two scans: no global round trip between reading the ids and writing the layout (a third less a talker layer
at 64 rows: docs/performance.md). Past that, the pair count per expert comes from atomic adds (which also give each pair
its rank inside its expert), the padded offsets from a cumulative sum. Either way padding rows hold
``num_pairs`` (no pair); the order inside a run changes nothing, since every GEMM row is computed on its own.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from omni_triton.kernels.dependent_launch import enabled_for, wait_for_previous


@triton.jit
def _route_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_logits,
                  TOP_K: tl.constexpr, TOP_K_POW2: tl.constexpr, NORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
                  PDL: tl.constexpr):
    wait_for_previous(PDL)
    token = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    logits = tl.load(logits_ptr + token * stride_logits + experts, mask=experts < num_experts,
                     other=float("-inf")).to(tl.float32)
    probs = tl.exp(logits - tl.max(logits, axis=0))
    probs = probs / tl.sum(probs, axis=0)
    slots = tl.arange(0, TOP_K_POW2)
    top_weights = tl.zeros([TOP_K_POW2], dtype=tl.float32)
    top_ids = tl.zeros([TOP_K_POW2], dtype=tl.int32)
    for slot in tl.static_range(TOP_K):
        best = tl.max(probs, axis=0)
        best_id = tl.min(tl.where(probs == best, experts, BLOCK_E), axis=0)  # ties: the lowest expert id
        top_weights = tl.where(slots == slot, best, top_weights)
        top_ids = tl.where(slots == slot, best_id, top_ids)
        probs = tl.where(experts == best_id, -1.0, probs)
    if NORMALIZE:
        top_weights = top_weights / tl.sum(top_weights, axis=0)
    tl.store(weights_ptr + token * TOP_K + slots, top_weights.to(weights_ptr.dtype.element_ty), mask=slots < TOP_K)
    tl.store(ids_ptr + token * TOP_K + slots, top_ids, mask=slots < TOP_K)


def route(router_logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``models.layers.moe.route``: (weights [T, k] in the logits' dtype, ids [T, k] int32)."""
    num_tokens, num_experts = router_logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=router_logits.dtype, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=router_logits.device)
    if num_tokens:
        pdl = enabled_for(router_logits)
        _route_kernel[(num_tokens,)](router_logits, weights, ids, num_experts, router_logits.stride(0),
                                     TOP_K=top_k, TOP_K_POW2=triton.next_power_of_2(top_k), NORMALIZE=normalize,
                                     BLOCK_E=triton.next_power_of_2(num_experts), num_warps=1, PDL=pdl, launch_pdl=pdl)
    return weights, ids


@triton.jit
def _expert_sorted_layout_kernel(expert_ids_ptr, sorted_pairs_ptr, block_expert_ptr, counts_ptr, ranks_ptr,
                                 num_pairs, num_experts, max_padded, max_blocks,
                                 BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr,
                                 BLOCK_CHUNK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    experts = tl.arange(0, BLOCK_E)
    expert_mask = experts < num_experts
    chunk = tl.arange(0, CHUNK)
    tl.store(counts_ptr + experts, tl.zeros([BLOCK_E], dtype=tl.int32), mask=expert_mask)
    tl.debug_barrier()
    for start in range(0, num_pairs, CHUNK):
        pairs = start + chunk
        mask = pairs < num_pairs
        expert = tl.load(expert_ids_ptr + pairs, mask=mask, other=0)
        rank = tl.atomic_add(counts_ptr + expert, tl.full([CHUNK], 1, tl.int32), mask=mask)
        tl.store(ranks_ptr + pairs, rank, mask=mask)
    for start in range(0, max_padded, CHUNK):
        rows = start + chunk
        tl.store(sorted_pairs_ptr + rows, tl.full([CHUNK], 0, tl.int32) + num_pairs, mask=rows < max_padded)
    tl.debug_barrier()
    counts = tl.load(counts_ptr + experts, mask=expert_mask, other=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    block_ends = ends // BLOCK_M
    for start in range(0, max_blocks, BLOCK_CHUNK):
        blocks = start + tl.arange(0, BLOCK_CHUNK)
        # the expert of block b is the number of experts whose run ends at or before it
        owner = tl.sum((block_ends[None, :] <= blocks[:, None]).to(tl.int32), axis=1)
        owner = tl.where(owner < num_experts, owner, -1)
        tl.store(block_expert_ptr + blocks, owner, mask=blocks < max_blocks)
    tl.debug_barrier()  # every thread has read the counts before they are overwritten with the run starts
    tl.store(counts_ptr + experts, ends - padded, mask=expert_mask)
    tl.debug_barrier()
    for start in range(0, num_pairs, CHUNK):
        pairs = start + chunk
        mask = pairs < num_pairs
        expert = tl.load(expert_ids_ptr + pairs, mask=mask, other=0)
        row = tl.load(counts_ptr + expert, mask=mask, other=0) + tl.load(ranks_ptr + pairs, mask=mask, other=0)
        tl.store(sorted_pairs_ptr + row, pairs, mask=mask)


@triton.jit
def _run_first(key_a, first_a, key_b, first_b):
    """Scan combine over sorted keys: the later key (a position's own), the smallest position holding it."""
    return tl.maximum(key_a, key_b), tl.where(key_a == key_b, tl.minimum(first_a, first_b),
                                              tl.where(key_a > key_b, first_a, first_b))


@triton.jit
def _run_last(key_a, last_a, key_b, last_b):
    """Reverse-scan combine over sorted keys: the earlier key (a position's own), the largest position holding
    it. Both combines are commutative, so they do not depend on the scan's operand order."""
    return tl.minimum(key_a, key_b), tl.where(key_a == key_b, tl.maximum(last_a, last_b),
                                              tl.where(key_a < key_b, last_a, last_b))


@triton.jit
def _sorted_layout_kernel(expert_ids_ptr, sorted_pairs_ptr, block_expert_ptr, num_pairs, num_experts, max_padded,
                          max_blocks, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, CHUNK: tl.constexpr,
                          PDL: tl.constexpr):
    """The layout of up to BLOCK_P pairs from one read of the ids: sort, scan, scatter."""
    wait_for_previous(PDL)
    lanes = tl.arange(0, BLOCK_P)
    expert = tl.load(expert_ids_ptr + lanes, mask=lanes < num_pairs, other=num_experts)  # past the end: sorts last
    for start in range(0, max_padded, CHUNK):  # padding rows: no pair (the real pairs overwrite theirs below)
        rows = start + tl.arange(0, CHUNK)
        tl.store(sorted_pairs_ptr + rows, tl.full([CHUNK], 0, tl.int32) + num_pairs, mask=rows < max_padded)
    keys = tl.sort(expert * BLOCK_P + lanes)  # by expert, then pair: each expert's run in pair order
    run_expert, pair = keys // BLOCK_P, keys % BLOCK_P
    real = lanes < num_pairs  # sorted positions: the real pairs come first
    _, first = tl.associative_scan((run_expert, lanes), 0, _run_first)
    _, last = tl.associative_scan((run_expert, lanes), 0, _run_last, reverse=True)
    # each run is padded to whole blocks: its waste sits at its last position, and a pair's row is its sorted
    # position plus the waste of the runs before its own
    waste = tl.where(real & (lanes == last), (BLOCK_M - (last - first + 1) % BLOCK_M) % BLOCK_M, 0)
    row = lanes + tl.cumsum(waste, 0) - waste
    used_blocks = (num_pairs + tl.sum(waste, 0)) // BLOCK_M
    tl.debug_barrier()  # every padding store before the pairs' own (same addresses, other threads)
    tl.store(sorted_pairs_ptr + row, pair.to(tl.int32), mask=real)
    tl.store(block_expert_ptr + row // BLOCK_M, run_expert.to(tl.int32), mask=real & (row % BLOCK_M == 0))
    for start in range(0, max_blocks, CHUNK):
        blocks = start + tl.arange(0, CHUNK)
        tl.store(block_expert_ptr + blocks, tl.full([CHUNK], -1, tl.int32),
                 mask=(blocks >= used_blocks) & (blocks < max_blocks))


# Up to this many pairs the layout is sorted in registers (_sorted_layout_kernel), past it counted by atomics
SORT_MAX_PAIRS = 1024


def max_sorted_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound of the padded runs' blocks: every hit expert wastes at most block_m - 1 rows."""
    return triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m)


def expert_sorted_layout(expert_ids: torch.Tensor, num_experts: int, block_m: int,
                         sorted_layout: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """expert_ids [T, k] -> (sorted_pairs [max_blocks * block_m] int32: pair index t * k + slot, or T * k
    for padding; block_expert [max_blocks] int32: the expert of each block_m rows, -1 past the last run).
    ``sorted_layout=False`` takes the atomic-count kernel at any size (tests compare the two)."""
    num_pairs = expert_ids.numel()
    max_blocks = max_sorted_blocks(num_pairs, num_experts, block_m)
    max_padded = max_blocks * block_m
    pdl = enabled_for(expert_ids)
    if num_pairs <= SORT_MAX_PAIRS and sorted_layout:
        layout = torch.empty(max_padded + max_blocks, dtype=torch.int32, device=expert_ids.device)
        sorted_pairs, block_expert = layout.split([max_padded, max_blocks])
        _sorted_layout_kernel[(1,)](
            expert_ids.reshape(-1), sorted_pairs, block_expert, num_pairs, num_experts, max_padded, max_blocks,
            BLOCK_M=block_m, BLOCK_P=max(16, triton.next_power_of_2(num_pairs)), CHUNK=1024, num_warps=4, PDL=pdl,
            launch_pdl=pdl)
        return sorted_pairs, block_expert
    scratch = torch.empty(max_padded + max_blocks + num_experts + num_pairs, dtype=torch.int32,
                          device=expert_ids.device)
    sorted_pairs, block_expert, counts, ranks = scratch.split([max_padded, max_blocks, num_experts, num_pairs])
    _expert_sorted_layout_kernel[(1,)](
        expert_ids.reshape(-1), sorted_pairs, block_expert, counts, ranks, num_pairs, num_experts, max_padded,
        max_blocks, BLOCK_M=block_m, BLOCK_E=triton.next_power_of_2(num_experts), CHUNK=256, BLOCK_CHUNK=32,
        num_warps=8, PDL=pdl, launch_pdl=pdl)
    return sorted_pairs, block_expert
