"""Warm start: dummy requests through an engine, before its stage reports ready, at every shape serving will run.

Why: the first burst after a server reports ready paid for first uses -- Triton kernels JIT-compiled per
specialisation (the fused MoE's block config changes with a step's token count, paged decode attention's split
count with the decode batch, integer arguments specialise on 1 and on multiples of 16), cuBLAS/cuDNN picking
kernels for new shapes, the samplers' kernels -- and took twice as long as the same burst warm (issue 19).
The decode and completion CUDA graphs are captured when the runner is built; this runs everything else through
the engine's own step, so exactly the serving code paths see each shape once:
- prefill: one request of each size in ``WarmupPlan.prefill_tokens`` (1 .. the step's token budget: powers of
  two and sizes off the multiples of 16; past the budget, a chunked prefill over cached context);
- batches: a ramp of ``max_num_seqs`` requests that runs a mixed step (decode rows + a newcomer's prefill) at
  every decode row count below ``max_num_seqs``, decode steps between, then a decode step at every batch size
  down from it (greedy and sampled rows, with a repetition penalty: both sampler paths). Every size, not only
  the graph buckets:
  mixed steps run eagerly, and paged decode attention's split count changes with the decode rows.
What a stage feeds its dummy requests comes from its ``warmup_inputs`` hook (the talker's never wait for text).
Afterwards the engine is idle -- no request, every KV block free (asserted), preemption count back to 0 -- and
its outputs are those of a fresh engine: the requests' seeds and draw counts are per request, and every
request writes a KV slot before anything reads it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from omni_triton.engine.engine import LLMEngine
from omni_triton.engine.runner import graph_buckets
from omni_triton.engine.sampling import SamplingParams
from omni_triton.warmup_progress import PROGRESS_MARK

DECODE_STEPS = 3  # tokens of a prefill warm-up request: its prefill, then decode steps at batch 1


@dataclass(frozen=True)
class WarmupPlan:
    prefill_tokens: tuple[int, ...]  # prompt lengths, one request each, run alone
    max_batch: int  # the batch ramp's largest decode batch (the engine's max_num_seqs)

    @classmethod
    def for_engine(cls, engine: LLMEngine) -> "WarmupPlan":
        config = engine.config
        budget, capacity = config.max_num_batched_tokens, engine.block_manager.num_blocks * config.block_size
        sizes = {1, 3, budget, budget + 3}  # budget + 3: a second chunk over cached context
        power = 2
        while power <= budget:
            sizes |= {power, power + 3}  # on and off the multiples of 16 that Triton specialises on
            power *= 2
        fits = tuple(sorted(n for n in sizes if n + DECODE_STEPS <= capacity))
        return cls(prefill_tokens=fits, max_batch=config.max_num_seqs)

    @property
    def buckets(self) -> list[int]:
        """Decode batches the ramp reports its progress at (the decode graphs' buckets)."""
        return graph_buckets(self.max_batch)

    def __len__(self) -> int:
        return len(self.prefill_tokens) + len(self.buckets) + 1


def warm_up(engine: LLMEngine, plan: WarmupPlan | None = None,
            log: Callable[[str], None] = lambda line: print(line, flush=True)) -> float:
    """Runs ``plan`` (default: ``WarmupPlan.for_engine``) through ``engine`` (not running in an EngineLoop yet),
    logging progress lines; returns the seconds it took. Raises RuntimeError if the engine is not idle
    afterwards.

    The batch ramp: ``max_batch`` requests of 2-token prompts, one added per scheduled step (a step launched
    ahead of its arrival, the decode rows alone, may come first), each generating ``2 * max_batch + 1`` tokens.
    The step that admits request k is a mixed step (k decode rows + the newcomer's prefill) for every k below
    ``max_batch``; then the requests finish one or two steps apart, so the decode batch runs every size from
    ``max_batch`` down to 1 (a graph replay per bucket, or eager decode with the graphs off)."""
    if engine.requests:
        raise RuntimeError(f"warm-up needs an idle engine, {len(engine.requests)} requests are in it")
    plan = plan or WarmupPlan.for_engine(engine)
    start = time.monotonic()
    done = 0

    def progress(what: str) -> None:
        nonlocal done
        done += 1
        log(f"{engine.name}: {PROGRESS_MARK} {done}/{len(plan)}: {what} ({time.monotonic() - start:.1f} s)")

    # prefix caching off meanwhile: the dummy prompts share prefixes, and each prefill must run at its full size
    caching, engine.block_manager.prefix_caching = engine.block_manager.prefix_caching, False
    try:
        for tokens in plan.prefill_tokens:
            _add(engine, f"prefill-{tokens}", tokens, index=tokens, max_new_tokens=DECODE_STEPS)
            _run(engine)
            progress(f"prefill of {tokens} tokens")
        for k in range(plan.max_batch):
            name = f"batch-{k}"
            _add(engine, name, 2, index=k, max_new_tokens=2 * plan.max_batch + 1)
            # (a step launched ahead of its arrival, the decode rows alone, comes first: overlap.py)
            while engine.requests[f"warmup-{name}"].num_computed_tokens == 0:
                engine.step()
            if k + 1 in plan.buckets:
                progress(f"mixed steps of up to {k} decode rows + a prefill")
        _run(engine)
        progress(f"decode batches {plan.max_batch} down to 1")
    finally:
        engine.block_manager.prefix_caching = caching
    _check_idle(engine)
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # the largest prefill's activations back to the device, for the other stages
    elapsed = time.monotonic() - start
    log(f"{engine.name}: {PROGRESS_MARK} done in {elapsed:.1f} s")
    return elapsed


def _add(engine: LLMEngine, name: str, num_positions: int, index: int, max_new_tokens: int) -> None:
    if index % 2:  # the sampling path: temperature, top-k, top-p and the repetition penalty's token history
        params = SamplingParams(temperature=0.9, top_k=50, top_p=0.8, repetition_penalty=1.05, seed=index,
                                max_new_tokens=max_new_tokens)
    else:
        params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    engine.add_request(f"warmup-{name}", params, **engine.stage.warmup_inputs(num_positions))


def _run(engine: LLMEngine) -> None:
    while engine.has_work():
        engine.step()


def _check_idle(engine: LLMEngine) -> None:
    scheduler = engine.scheduler
    if engine.requests or scheduler.waiting or scheduler.running or engine.block_manager.num_used:
        raise RuntimeError(f"warm-up left the {engine.name} engine busy: {len(engine.requests)} requests, "
                           f"{engine.block_manager.num_used} KV blocks in use")
    scheduler.num_preemptions = 0  # the warm-up's (a small cache) are not serving's
