"""Per-request sampling: logits processors (HF semantics) and seeded sampling.

Every request owns a ``torch.Generator``: its draws depend only on its own seed and its own logits, never
on which other requests share the batch, so a seed reproduces its output under any batch composition.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch


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

    def record(self, token_id: int) -> None:
        self.seen_ids.add(token_id)
        self.num_generated += 1


@functools.lru_cache(maxsize=64)
def _id_tensor(ids: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long, device=device)


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
        if row.num_generated < p.min_new_tokens and p.stop_token_ids:
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
