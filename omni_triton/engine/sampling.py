"""Per-request sampling: logits processors (HF semantics) and seeded sampling.

Every request owns a ``torch.Generator``: its draws depend only on its own seed and its own logits, never
on which other requests share the batch, so a seed reproduces its output under any batch composition.

``DeviceSampler`` is the GPU fast path of the same processors: per-row controls in device buffers the host
refills with one copy per step, repetition history and banned ids kept on the device per request
(``TokenHistory``), exponential-race sampling over counter-based uniforms keyed by (request seed, draw index)
(``kernels.random``). No step reads anything back to the host, so a CUDA graph can capture it (the talker's
code predictor samples 15 times inside one). Its draws are as reproducible and batch-independent as the
CPU path's, but they are a different random stream: a seed gives other samples on the fast path. Top-k keeps
exactly k candidates (ties at the k-th value are cut; the CPU path keeps them). The launches
(``kernels.sampling``): the penalties and bans in one, then the row kernel over the whole row (up to
``SMALL_VOCAB`` ids: the talker, the code predictor) or over a ``torch.topk`` of it (the thinker's ~152k ids
with every row's top_k at most that), else ``race_sample``'s torch ops (a row without a top_k: a full sort).
"""

from __future__ import annotations

import functools
import operator
import random
from dataclasses import dataclass, field

import numpy as np
import torch

from omni_triton.engine.handoff import to_device_async
from omni_triton.engine.host_copies import StagingGuard


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    min_new_tokens: int = 0
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # benchmarks: never stop on stop_token_ids
    suppressed_token_ids: tuple[int, ...] = ()
    extra: dict = field(default_factory=dict)  # stage-specific knobs (e.g. the talker's code-predictor params)

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(f"min_new_tokens must be in [0, max_new_tokens={self.max_new_tokens}], "
                             f"got {self.min_new_tokens}")
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        self.suppressed_token_ids = tuple(int(t) for t in self.suppressed_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator:
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    return generator


@dataclass
class SampleRow:
    """What the sampler needs to know about one row of logits."""
    params: SamplingParams
    generator: torch.Generator
    seen_ids: set[int] = field(default_factory=set)  # ids the repetition penalty applies to
    num_generated: int = 0  # for min_new_tokens
    seed: int | None = None  # DeviceSampler's key: the request's seed, else a random one

    def __post_init__(self):
        if self.seed is None:
            self.seed = self.params.seed if self.params.seed is not None else random.getrandbits(62)

    @property
    def stop_ids_banned(self) -> bool:
        return self.stop_ids_banned_after(0)

    def stop_ids_banned_after(self, tokens_ahead: int) -> bool:
        """Whether the stop ids are banned once ``tokens_ahead`` more tokens are recorded."""
        return self.num_generated + tokens_ahead < self.params.min_new_tokens and bool(self.params.stop_token_ids)

    def record(self, token_id: int) -> None:
        self.seen_ids.add(token_id)
        self.num_generated += 1


@functools.lru_cache(maxsize=64)
def _id_tensor(ids: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return to_device_async(torch.tensor(ids, dtype=torch.long), device)


def apply_penalties(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Repetition penalty, suppressed ids and min_new_tokens (stop ids masked), in place on float32 logits.
    Batched: one gather/scatter for all penalised (row, id) pairs, one masked write per distinct id list."""
    device = logits.device
    penalty_rows, penalty_ids, penalties = [], [], []
    masked: dict[tuple[int, ...], list[int]] = {}
    for i, row in enumerate(rows):
        p = row.params
        if p.repetition_penalty != 1.0 and row.seen_ids:
            penalty_rows += [i] * len(row.seen_ids)
            penalty_ids += row.seen_ids
            penalties += [p.repetition_penalty] * len(row.seen_ids)
        if p.suppressed_token_ids:
            masked.setdefault(p.suppressed_token_ids, []).append(i)
        if row.stop_ids_banned:
            masked.setdefault(p.stop_token_ids, []).append(i)
    if penalty_rows:
        r = torch.tensor(penalty_rows, device=device)
        c = torch.tensor(penalty_ids, device=device)
        factor = torch.tensor(penalties, dtype=logits.dtype, device=device)
        score = logits[r, c]
        logits[r, c] = torch.where(score < 0, score * factor, score / factor)
    for ids, row_list in masked.items():
        logits[torch.tensor(row_list, device=device)[:, None], _id_tensor(ids, device)[None, :]] = float("-inf")
    return logits


def warp(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Temperature, top-k, top-p (HF warper semantics), batched with per-row values. Returns probabilities."""
    device = logits.device
    temperature = torch.tensor([r.params.temperature for r in rows], dtype=logits.dtype, device=device)
    scaled = logits / temperature[:, None]
    # A tiny temperature (e.g. 1e-40, a valid TEMPERATURE) overflows logits to inf and softmax to NaN; such rows
    # are scaled after subtracting their max instead (the same distribution: only the top logit survives).
    overflow = (torch.isinf(scaled) & torch.isfinite(logits)).any(dim=-1, keepdim=True)
    logits = torch.where(overflow, (logits - logits.max(dim=-1, keepdim=True).values) / temperature[:, None], scaled)
    top_k = [r.params.top_k for r in rows]
    if any(k > 0 for k in top_k):
        vocab = logits.shape[-1]
        k = [min(k, vocab) if k > 0 else vocab for k in top_k]
        kth_index = torch.tensor(k, device=device)[:, None] - 1
        kth = torch.topk(logits, max(k), dim=-1).values.gather(1, kth_index)  # ties at the k-th value are kept
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if any(r.params.top_p < 1.0 for r in rows):
        top_p = torch.tensor([r.params.top_p for r in rows], dtype=logits.dtype, device=device)
        sorted_logits, sorted_idx = logits.sort(dim=-1)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - top_p)[:, None]
        remove[:, -1] = False  # always keep the most likely token
        logits = logits.masked_fill(remove.scatter(1, sorted_idx, remove), float("-inf"))
    return logits.softmax(dim=-1)


def sample(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """logits [N, V] float32 -> token ids [N] (long, on logits' device)."""
    if logits.shape[0] != len(rows):
        raise ValueError(f"sample: {logits.shape[0]} logit rows for {len(rows)} requests")
    logits = apply_penalties(logits.float().clone(), rows)
    out = logits.argmax(dim=-1)
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    if sampled:
        probs = warp(logits[sampled], [rows[i] for i in sampled])
        for j, i in enumerate(sampled):
            out[i] = torch.multinomial(probs[j], 1, generator=rows[i].generator)[0]
    return out


# ---------------------------------------------------------------------------------------------- GPU fast path

_MASK64 = (1 << 64) - 1


def draw_seed(row_seed: int, draw: int) -> int:
    """The uniforms' key of a request's ``draw``-th sample (splitmix64 of both): distinct per draw."""
    x = (row_seed * 0x9E3779B97F4A7C15 + draw + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 2  # 62 bits: room for the in-graph group offsets


VECTOR_SEEDS_FROM = 16  # rows; numpy's ~8 us a call beats ~0.4 us a row of Python ints from about here
_GOLDEN, _MIX1, _MIX2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_SHIFTS = tuple(map(np.uint64, (30, 27, 31, 2)))  # (numpy scalars made once: a conversion per operation fewer)


def draw_seed_bases(row_seeds: np.ndarray) -> np.ndarray:
    """The part of ``draw_seeds`` that depends on the row seeds only (uint64): kept while a batch's rows stay."""
    return row_seeds * _GOLDEN + np.uint64(1)


def draw_seeds(row_seeds: np.ndarray, draws: np.ndarray) -> np.ndarray:
    """``draw_seed`` of each (row seed, draw) pair at once (uint64 arrays, whose products wrap mod 2**64 as the
    scalar version's masks do) -> int64."""
    out = np.empty(len(draws), dtype=np.int64)
    draw_seeds_into(draw_seed_bases(row_seeds), draws, out)
    return out


def draw_seeds_into(bases: np.ndarray, draws: np.ndarray, out: np.ndarray) -> None:
    """``draw_seeds`` from the rows' ``draw_seed_bases``, written into the contiguous int64 array ``out`` (a
    sampler's control column: no result array to copy there), in place where numpy allows."""
    x = out.view(np.uint64)
    np.add(bases, draws, out=x)
    x ^= x >> _SHIFTS[0]
    x *= _MIX1
    x ^= x >> _SHIFTS[1]
    x *= _MIX2
    x ^= x >> _SHIFTS[2]
    x >>= _SHIFTS[3]


MAX_BANNED_ROWS = 64  # TokenHistory's banned rows kept, one per distinct (stop ids, suppressed ids)


class TokenHistory:
    """Per-request rows on the device: ``seen`` (ids the repetition penalty applies to) and ``banned``
    (1: always, the suppressed ids; 2: while under min_new_tokens, the stop ids). A request gets a slot when
    it first samples, filled from its host ``SampleRow``, and the slot follows every sampled id in place; the
    last slot is scratch for padding rows."""

    ALWAYS, UNDER_MIN = 1, 2

    def __init__(self, num_slots: int, vocab_size: int, device: torch.device):
        self.seen = torch.zeros(num_slots + 1, vocab_size, dtype=torch.bool, device=device)
        self.banned = torch.zeros(num_slots + 1, vocab_size, dtype=torch.int8, device=device)
        self._true = torch.ones((), dtype=torch.bool, device=device)  # a device value: no copy inside a graph
        self.padding_slot = num_slots
        self.version = 0  # bumped whenever a slot is given or freed (DeviceSampler.prepare's cache reads it)
        self._free = list(range(num_slots))
        self._slots: dict[str, int] = {}
        self._banned_rows: dict[tuple, torch.Tensor] = {}  # (stop ids, suppressed ids) -> a slot's banned row

    def slot(self, key: str, row: SampleRow) -> int:
        if key in self._slots:
            return self._slots[key]
        if not self._free:
            raise RuntimeError(f"TokenHistory: no free slot for {key!r} ({self.padding_slot} in use)")
        slot = self._slots[key] = self._free.pop()
        self.version += 1
        device = self.seen.device
        self.seen[slot] = False
        if row.seen_ids:
            # No copy that waits for the stream, behind every step queued on it (a row's first sampler preparation
            # is on the engine thread): the ids from pinned memory (``torch.tensor(ids, device=...)`` copies from
            # pageable memory, then synchronises), the value a scalar argument (``x[ids] = True`` makes a CPU tensor
            # of it and ``index_put_`` copies that to the device, synchronising)
            self.seen[slot].index_fill_(0, to_device_async(torch.tensor(sorted(row.seen_ids)), device), True)
        # one copy of a row made once per pair of id lists (requests share them), not a fill and two index writes per
        # new row (each write's value was copied to the device with a stream synchronisation: ~27% of the H200
        # talker's steps with prefill rows, benchmarks/results/cpu-talker-admission)
        self.banned[slot] = self._banned_row(row.params.stop_token_ids, row.params.suppressed_token_ids)
        return slot

    def _banned_row(self, stop_ids: tuple[int, ...], suppressed_ids: tuple[int, ...]) -> torch.Tensor:
        key = (stop_ids, suppressed_ids)
        banned = self._banned_rows.get(key)
        if banned is None:
            if len(self._banned_rows) >= MAX_BANNED_ROWS:  # (requests with ever new lists: made again when due)
                self._banned_rows.clear()
            device = self.banned.device
            banned = self._banned_rows[key] = torch.zeros(self.banned.shape[1], dtype=torch.int8, device=device)
            for ids, kind in ((stop_ids, self.UNDER_MIN), (suppressed_ids, self.ALWAYS)):
                if ids:
                    banned.index_fill_(0, _id_tensor(ids, device), kind)  # (a scalar argument: no copy, as above)
        return banned

    def record(self, slots: torch.Tensor, ids: torch.Tensor) -> None:
        self.seen.index_put_((slots, ids), self._true)

    def release(self, key: str) -> None:
        slot = self._slots.pop(key, None)
        if slot is not None:
            self._free.append(slot)
            self.version += 1


class DeviceSampler:
    """Samples up to ``max_rows`` rows per step on the GPU. ``prepare`` (host) fills the per-row controls;
    ``sample`` (device only, capturable) applies penalties, bans, temperature, top-k, top-p and draws.

    Padding rows (past the prepared ones, up to a CUDA-graph bucket) are greedy and use the scratch slot."""

    def __init__(self, max_rows: int, device: torch.device, history: TokenHistory | None = None):
        self.history = history
        self.max_rows = max_rows
        # temperature, top_p, repetition_penalty | top_k, seed, history slot, stop ids banned
        pinned = torch.device(device).type == "cuda"
        self._host_floats = torch.zeros(3, max_rows, dtype=torch.float32, pin_memory=pinned)
        self._host_ints = torch.zeros(4, max_rows, dtype=torch.int64, pin_memory=pinned)
        self._reset_host()
        self._floats = self._host_floats.to(device)
        self._ints = self._host_ints.to(device)
        self._staging = StagingGuard(device)
        self.all_greedy, self.max_top_k, self.any_top_p = True, 0, False
        self._keys: list[str] = []  # the rows of the last prepare (``_fill_request_columns``)
        self._rows: list[SampleRow] = []
        self._slots_version = -1
        self._seed_bases = np.zeros(max_rows, dtype=np.uint64)  # the rows' draw_seed_bases, for draw_seeds_into
        self._ban_rows: list[int] = []  # rows with a min_new_tokens ban on stop ids (it lifts as they generate)

    def _reset_host(self) -> None:
        """Every row greedy, no penalty, no ban, on the scratch history slot."""
        floats, ints = self._host_floats.numpy(), self._host_ints.numpy()
        floats[0], floats[1], floats[2] = 0.0, 1.0, 1.0
        ints[0], ints[1], ints[3] = 0, 0, 0
        ints[2] = self.history.padding_slot if self.history is not None else 0

    def prepare(self, keys: list[str], rows: list[SampleRow], draws: list[int],
                tokens_ahead: int | list[int] = 0) -> None:
        """Controls of rows 0..n-1 (``draws``: each row's draw index, e.g. tokens generated so far;
        ``tokens_ahead``: tokens sampled but not recorded in the rows yet, which the min_new_tokens ban counts:
        for every row, or a row's each)."""
        if len(rows) > self.max_rows:
            raise ValueError(f"DeviceSampler: {len(rows)} rows, at most {self.max_rows}")
        self._staging.before_write()
        ints = self._host_ints.numpy()
        n = len(rows)
        # the same rows as the last call (a steady decode batch), no history slot given or freed since: their
        # per-request columns are still in place
        slots_version = self.history.version if self.history is not None else 0
        refill = not (keys == self._keys and slots_version == self._slots_version and len(rows) == len(self._rows)
                      and all(map(operator.is_, rows, self._rows)))
        if refill:
            self._fill_request_columns(keys, rows)
            self._slots_version = self.history.version if self.history is not None else 0
        if n:
            if n < VECTOR_SEEDS_FROM:
                ints[1, :n] = [draw_seed(row.seed, draw) for row, draw in zip(rows, draws)]
            else:
                draw_seeds_into(self._seed_bases[:n], np.asarray(draws, dtype=np.uint64), ints[1, :n])
            per_row = not isinstance(tokens_ahead, int)
            for i in self._ban_rows:  # (every other row's flag stays 0 from the fill)
                ints[3, i] = rows[i].stop_ids_banned_after(tokens_ahead[i] if per_row else tokens_ahead)
        if refill:  # (else the device holds them already: they change with the rows only)
            self._floats.copy_(self._host_floats, non_blocking=True)
        self._ints.copy_(self._host_ints, non_blocking=True)
        self._staging.copies_queued()

    def _fill_request_columns(self, keys: list[str], rows: list[SampleRow]) -> None:
        """What stays fixed for a request (temperature, top_p, penalty, top_k, history slot) and the batch's
        flags, written when the batch's rows change (column writes from lists: a per-row loop of numpy item
        writes was ~0.2 ms at 64 rows)."""
        self._reset_host()
        self._keys, self._rows = list(keys), list(rows)
        floats, ints = self._host_floats.numpy(), self._host_ints.numpy()
        n = len(rows)
        params = [row.params for row in rows]
        if n:
            floats[0, :n] = [p.temperature for p in params]
            floats[1, :n] = [p.top_p for p in params]
            floats[2, :n] = [p.repetition_penalty for p in params]
            ints[0, :n] = [p.top_k for p in params]
            self._seed_bases[:n] = draw_seed_bases(np.array([row.seed & _MASK64 for row in rows], dtype=np.uint64))
            if self.history is not None:
                ints[2, :n] = [self.history.slot(key, row) for key, row in zip(keys, rows)]
        self._ban_rows = [i for i, p in enumerate(params) if p.min_new_tokens > 0 and p.stop_token_ids]
        sampling = [p for p in params if not p.greedy]
        self.all_greedy = not sampling
        self.max_top_k = 0 if any(p.top_k == 0 for p in sampling) else max((p.top_k for p in sampling), default=0)
        self.any_top_p = any(p.top_p < 1.0 for p in sampling)

    def sample(self, logits: torch.Tensor, group: int = 0, general: bool = False) -> torch.Tensor:
        """logits [B, V] -> ids [B] (long). ``group`` offsets the draw (the code predictor's codebook);
        ``general`` ignores what ``prepare`` saw of the rows (for a CUDA graph, which must serve any rows)."""
        num_rows, vocab = logits.shape
        temperature, top_p, penalty = self._floats[:, :num_rows]
        top_k, seeds, slots, stop_banned = self._ints[:, :num_rows]
        from omni_triton.kernels.sampling import penalize, sample_candidates, sample_rows  # triton: CUDA runs

        # penalize, the argmax and sample_rows read any float dtype as fp32 (the code predictor hands bf16
        # logits: a cast launch per predictor step fewer); the multi-launch samplers take fp32
        if self.history is not None:
            logits = penalize(logits, penalty, slots, stop_banned, self.history.seen, self.history.banned,
                              always=TokenHistory.ALWAYS, under_min=TokenHistory.UNDER_MIN)
        if self.all_greedy and not general:
            ids = logits.argmax(dim=-1)
        elif vocab <= SMALL_VOCAB:
            ids = sample_rows(logits.contiguous(), temperature, top_k, top_p, seeds, group)
        elif not general and 0 < self.max_top_k <= SMALL_VOCAB:  # the thinker's top_k 20: ~10 launches, not ~30
            ids = sample_candidates(logits.float(), self.max_top_k, temperature, top_k, top_p, seeds, group)
        else:
            ids = race_sample(logits.float(), temperature, top_k, top_p, seeds + group,
                              max_top_k=0 if general else self.max_top_k, top_p_used=general or self.any_top_p)
        if self.history is not None:
            self.history.record(slots, ids)
        return ids


SMALL_VOCAB = 4096  # up to here one fused kernel samples a row (kernels.sampling); the same draws as race_sample


def race_sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                seeds: torch.Tensor, max_top_k: int = 0, top_p_used: bool = True) -> torch.Tensor:
    """Temperature, top-k, top-p and an exponential race over ``uniform_rows(seeds)`` keyed by candidate rank,
    in torch ops (any vocab). ``max_top_k`` > 0: every sampling row has 0 < top_k <= it, so only that many
    candidates are ranked (a top-k instead of a full sort). Rows with temperature 0 take the argmax."""
    from omni_triton.kernels.random import uniform_rows

    # subtracting the max first keeps a tiny temperature from overflowing (same distribution)
    scaled = (logits - logits.max(dim=-1, keepdim=True).values) / torch.where(temperature > 0, temperature,
                                                                               1.0)[:, None]
    if max_top_k:
        values, candidates = scaled.topk(min(max_top_k, logits.shape[1]), dim=-1)
    else:
        values, candidates = scaled.sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(values.shape[1], device=logits.device)
    values = values.masked_fill((top_k[:, None] > 0) & (ranks[None, :] >= top_k[:, None]), float("-inf"))
    probs = values.softmax(dim=-1)
    if top_p_used:  # keep the shortest prefix whose mass reaches top_p
        probs = probs.masked_fill(probs.cumsum(dim=-1) - probs >= top_p[:, None], 0.0)
    race = probs / -torch.log(uniform_rows(seeds, values.shape[1]))  # exponential race
    sampled = candidates.gather(1, race.argmax(dim=-1, keepdim=True))[:, 0]
    return torch.where(temperature > 0, sampled, logits.argmax(dim=-1))
