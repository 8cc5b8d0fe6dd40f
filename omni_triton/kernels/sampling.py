"""Temperature, top-k, top-p and a seeded draw for rows of a small vocabulary, one program per row.

For the talker (3072 codec ids) and its code predictor (2048 per codebook), which sample 16 times per frame
inside one CUDA graph: one launch replaces the ~25 of the torch formulation (``engine.sampling.
DeviceSampler``), and draws the same tokens: candidates sorted by value (ties: lower id first), the first k
kept, then the shortest prefix whose mass reaches top_p, then an exponential race over uniforms keyed by
(seed + group, rank) exactly as ``kernels.random.uniform_rows`` draws them. Rows with temperature 0 take the
argmax and skip the rest. Each candidate is one 64-bit key: the value's bits mapped to an order-preserving
integer, shifted up, with the inverted id in the low bits: keys are distinct, and their descending order is
the candidates' order.

A whole-row sort is what a launch cost (tens of microseconds for a few thousand ids: a bitonic sort is
~70 dependent stages through shared memory), so a row with 0 < top_k <= ``FAST_TOP_K`` (the talker's and the
predictor's 50) sorts nothing: it bisects the values for a threshold that at least k and at most
``SHORTLIST`` candidates reach (one count a round, ~15 rounds), gathers those to a scratch row, and ranks them
against each other (a ``SHORTLIST``-square compare): rank r of the shortlist is rank r of the full sort, so the
draw is the same. Rows whose threshold cannot get under ``SHORTLIST`` (more than that many values tied at the
k-th, e.g. a row banned down to fewer than k finite ids) and rows with top_k 0 or above ``FAST_TOP_K`` sort the
whole row.

A larger vocabulary (the thinker's ~152k ids) goes through ``sample_candidates``: a ``torch.topk`` of the
penalised logits, then ``sample_rows`` over those candidates (rank r among them is rank r of the row, so the
draw is ``engine.sampling.race_sample``'s) and a gather back to vocabulary ids. ``penalize`` applies the
repetition penalty and the bans of every row in one launch (``DeviceSampler``'s history: ~10 full-row torch
launches before).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from omni_triton.kernels.dependent_launch import enabled_for, wait_for_previous

MAX_VOCAB = 4096  # one row in one program's registers
FAST_TOP_K = 64  # rows with 0 < top_k <= this take the shortlist instead of the sort
SHORTLIST = 128  # at most this many candidates ranked pairwise (a [SHORTLIST, SHORTLIST] tile)


@triton.jit
def _ordered(values):
    """float32 -> int32 in the same order (negative floats: the magnitude bits flipped)."""
    bits = values.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _unordered(ordered):
    """``_ordered`` undone: int32 (any int dtype holding one) -> the float32 it came from."""
    bits = ordered.to(tl.int32)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)


@triton.jit
def _key_values(keys, ID_BITS: tl.constexpr):
    """Packed keys -> their float32 logits (``_ordered`` undone on the high bits)."""
    return _unordered(keys >> ID_BITS)


@triton.jit
def _softmax(values):
    probs = tl.exp(values - tl.max(values, axis=0))
    return probs / tl.sum(probs, axis=0)


@triton.jit
def _race_winner(keys, probs, ranks, positions, seed, BLOCK_V: tl.constexpr):
    """The exponential race over the kept mass (uniforms keyed by rank, so any order draws the same): the
    winner's vocabulary id (packed in the keys' low bits, reversed so that equal logits rank the lower id first)."""
    race = probs / -tl.log(tl.rand(seed, ranks))
    ids = (BLOCK_V - 1) - (keys & (BLOCK_V - 1)).to(tl.int32)
    return tl.sum(tl.where(positions == tl.argmax(race, axis=0), ids, 0), axis=0)


@triton.jit
def _race(keys, ranks, top_k, top_p, seed, BLOCK_V: tl.constexpr, ID_BITS: tl.constexpr):
    """keys sorted descending -> the sampled id (the reference formulation, over a whole sorted row)."""
    values = tl.where((top_k > 0) & (ranks >= top_k), float("-inf"), _key_values(keys, ID_BITS))
    probs = _softmax(values)
    probs = tl.where(tl.cumsum(probs, axis=0) - probs < top_p, probs, 0.0)
    return _race_winner(keys, probs, ranks, ranks, seed, BLOCK_V)


@triton.jit
def _shortlist_threshold(ordered, k, SHORT: tl.constexpr):
    """(t, count of ordered >= t, rounds) with k <= count <= SHORT if bisection finds one (else count > SHORT:
    ties); rounds: the counts it took after the first (tests).

    The bracket starts at the row's smallest finite value (below every value if fewer than k are finite) and
    its largest, and is halved in *value* (the midpoint of the two floats, as an ordered integer): halving the
    integers instead spent ~8-10 rounds on logit-like rows (the exponents between the k-th value and zero), each
    round a count over the whole row, against 2-4. A midpoint that does not land strictly inside the bracket (an
    end that is no finite float, or ends one float apart) falls back to the integer midpoint, so every round
    still shrinks the bracket."""
    top = tl.max(ordered, axis=0).to(tl.int64)
    finite = _unordered(ordered) > float("-inf")
    low = tl.full((), -(1 << 31), tl.int64)  # count(ordered >= low) >= k throughout
    if tl.sum(finite.to(tl.int32), axis=0) >= k:
        low = tl.min(tl.where(finite, ordered, top.to(tl.int32)), axis=0).to(tl.int64)
    high = top + 1  # count(ordered >= high) < k throughout
    count = tl.sum((ordered >= low).to(tl.int32), axis=0)
    rounds = 0
    while (count > SHORT) & (high - low > 1):
        rounds += 1
        halfway = 0.5 * _unordered(low) + 0.5 * _unordered(tl.minimum(high, top))
        middle = _ordered(halfway).to(tl.int64)
        if (middle <= low) | (middle >= high) | (halfway != halfway):
            middle = low + (high - low) // 2
        above = tl.sum((ordered.to(tl.int64) >= middle).to(tl.int32), axis=0)
        if above >= k:
            low, count = middle, above
        else:
            high = middle
    return low, count, rounds


@triton.jit
def _shortlist_race(keys, valid, top_k, top_p, seed, BLOCK_V: tl.constexpr, ID_BITS: tl.constexpr):
    """keys [SHORT] (any order; ``valid`` marks the real ones, at least min(top_k, count) of them) -> the sampled
    id: each key's rank and the mass above it counted pairwise, then the same cut and race as ``_race``."""
    greater = (keys[None, :] > keys[:, None]) & valid[None, :]  # [i, j]: key j ranks before key i
    ranks = tl.sum(greater.to(tl.int32), axis=1)
    probs = _softmax(tl.where(valid & (ranks < top_k), _key_values(keys, ID_BITS), float("-inf")))
    mass_above = tl.sum(tl.where(greater, probs[None, :], 0.0), axis=1)
    probs = tl.where(mass_above < top_p, probs, 0.0)
    return _race_winner(keys, probs, ranks, tl.arange(0, keys.shape[0]), seed, BLOCK_V)


@triton.jit
def _sample_rows_kernel(logits_ptr, stride_logits, vocab, temperature_ptr, top_k_ptr, top_p_ptr, seeds_ptr, group,
                        scratch_ptr, out_ptr, BLOCK_V: tl.constexpr, ID_BITS: tl.constexpr, FAST_K: tl.constexpr,
                        SHORT: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    row = tl.program_id(0)
    ranks = tl.arange(0, BLOCK_V)
    logits = tl.load(logits_ptr + row * stride_logits + ranks, mask=ranks < vocab,
                     other=float("-inf")).to(tl.float32)
    temperature = tl.load(temperature_ptr + row)
    if temperature > 0:
        top_k = tl.load(top_k_ptr + row)
        top_p = tl.load(top_p_ptr + row)
        seed = tl.load(seeds_ptr + row) + group
        ordered = _ordered((logits - tl.max(logits, axis=0)) / temperature)
        keys = (ordered.to(tl.int64) << ID_BITS) | (BLOCK_V - 1 - ranks).to(tl.int64)
        threshold = tl.full((), 0, tl.int64)
        count = tl.full((), SHORT + 1, tl.int32)  # no shortlist unless the bisection below finds one
        if (top_k > 0) & (top_k <= FAST_K):
            threshold, count, _ = _shortlist_threshold(ordered, tl.minimum(top_k, BLOCK_V).to(tl.int32), SHORT)
        if count <= SHORT:
            chosen = ordered.to(tl.int64) >= threshold
            slots = tl.cumsum(chosen.to(tl.int32), axis=0) - 1
            tl.store(scratch_ptr + row * SHORT + slots, keys, mask=chosen)
            tl.debug_barrier()  # the shortlist, stored by every thread of this program, visible to all
            short = tl.arange(0, SHORT)
            shortlist = tl.load(scratch_ptr + row * SHORT + short, mask=short < count, other=0)
            sampled = _shortlist_race(shortlist, short < count, top_k, top_p, seed, BLOCK_V, ID_BITS)
        else:
            sampled = _race(tl.sort(keys, descending=True), ranks, top_k, top_p, seed, BLOCK_V, ID_BITS)
        tl.store(out_ptr + row, sampled.to(tl.int64))
    else:
        tl.store(out_ptr + row, tl.argmax(logits, axis=0).to(tl.int64))


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                seeds: torch.Tensor, group: int = 0) -> torch.Tensor:
    """logits [B, V <= MAX_VOCAB] (any float dtype: read as float32), per-row controls [B] -> ids [B] int64."""
    num_rows, vocab = logits.shape
    if vocab > MAX_VOCAB or logits.stride(1) != 1:
        raise ValueError(f"sample_rows takes at most {MAX_VOCAB} contiguous logits per row, got {vocab}")
    out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    if num_rows:
        block_v = max(16, triton.next_power_of_2(vocab))
        id_bits = block_v.bit_length() - 1
        scratch = torch.empty(num_rows, SHORTLIST, dtype=torch.int64, device=logits.device)
        pdl = enabled_for(logits)
        _sample_rows_kernel[(num_rows,)](logits, logits.stride(0), vocab, temperature, top_k, top_p, seeds, group,
                                         scratch, out, BLOCK_V=block_v, ID_BITS=id_bits, FAST_K=FAST_TOP_K,
                                         SHORT=SHORTLIST, num_warps=8, PDL=pdl, launch_pdl=pdl)
    return out


@triton.jit
def _penalize_kernel(logits_ptr, stride_logits, out_ptr, vocab, penalty_ptr, slots_ptr, stop_banned_ptr, seen_ptr,
                     banned_ptr, stride_history, ALWAYS: tl.constexpr, UNDER_MIN: tl.constexpr,
                     BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = cols < vocab
    x = tl.load(logits_ptr + row * stride_logits + cols, mask=valid, other=0.0).to(tl.float32)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    penalty = tl.load(penalty_ptr + row)
    seen = tl.load(seen_ptr + slot * stride_history + cols, mask=valid, other=0)
    penalised = tl.where(x < 0, x * penalty, tl.math.div_rn(x, penalty))  # IEEE division, as torch's
    x = tl.where(seen != 0, penalised, x)
    banned = tl.load(banned_ptr + slot * stride_history + cols, mask=valid, other=0)
    stop_banned = tl.load(stop_banned_ptr + row)
    x = tl.where((banned == ALWAYS) | ((banned == UNDER_MIN) & (stop_banned > 0)), float("-inf"), x)
    tl.store(out_ptr + row * vocab + cols, x, mask=valid)


def penalize(logits: torch.Tensor, penalty: torch.Tensor, slots: torch.Tensor, stop_banned: torch.Tensor,
             seen: torch.Tensor, banned: torch.Tensor, *, always: int, under_min: int) -> torch.Tensor:
    """logits [B, V] (any float dtype) -> float32 [B, V]: each row's seen ids (``seen[slots[b]]`` nonzero)
    divided by its ``penalty`` when positive, multiplied when negative (HF's repetition penalty), then -inf where
    ``banned[slots[b]]`` is ``always``, or ``under_min`` while ``stop_banned[b]`` (``engine.sampling.
    TokenHistory``'s codes, passed by its caller).
    ``seen`` [slots, V] bool or uint8, ``banned`` [slots, V] int8, both contiguous."""
    num_rows, vocab = logits.shape
    if logits.stride(1) != 1 or seen.shape[1] != vocab or banned.shape != seen.shape:
        raise ValueError(f"penalize: logits {tuple(logits.shape)} (last dim contiguous), seen {tuple(seen.shape)} "
                         f"and banned {tuple(banned.shape)} must share the vocabulary")
    if not (seen.is_contiguous() and banned.is_contiguous()):
        raise ValueError("penalize: seen and banned must be contiguous")
    out = torch.empty(num_rows, vocab, dtype=torch.float32, device=logits.device)
    if num_rows:
        block = 2048
        pdl = enabled_for(logits)
        seen_bytes = seen.view(torch.uint8) if seen.dtype == torch.bool else seen
        _penalize_kernel[(num_rows, triton.cdiv(vocab, block))](
            logits, logits.stride(0), out, vocab, penalty, slots, stop_banned, seen_bytes, banned, seen.stride(0),
            ALWAYS=always, UNDER_MIN=under_min, BLOCK=block, num_warps=4, PDL=pdl, launch_pdl=pdl)
    return out


def sample_candidates(logits: torch.Tensor, num_candidates: int, temperature: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor, seeds: torch.Tensor, group: int = 0) -> torch.Tensor:
    """``sample_rows`` for any vocabulary when every sampling row has 0 < top_k <= ``num_candidates`` (at most
    ``MAX_VOCAB``): the row's ``num_candidates`` best logits (``torch.topk``, descending), drawn from by rank,
    mapped back to vocabulary ids; rows with temperature 0 take the row's argmax (lowest id among ties)."""
    if not 0 < num_candidates <= MAX_VOCAB:
        raise ValueError(f"sample_candidates: 1 to {MAX_VOCAB} candidates a row, got {num_candidates}")
    values, candidates = logits.topk(min(num_candidates, logits.shape[1]), dim=-1)
    picked = sample_rows(values.contiguous(), temperature, top_k, top_p, seeds, group)
    sampled = candidates.gather(1, picked[:, None])[:, 0]
    return torch.where(temperature > 0, sampled, logits.argmax(dim=-1))
