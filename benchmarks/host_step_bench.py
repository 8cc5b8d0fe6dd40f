"""Host bookkeeping of one engine decode step, without a model: what the GPU waits on between two replays.

    python benchmarks/host_step_bench.py --rows 1,8,32,64 --out-dir /tmp/host_step
    PYTHONPATH=<other tree> python -P benchmarks/host_step_bench.py ...   # the same workload on another tree

Per row count: ``Scheduler.schedule`` over that many running decode sequences (their blocks already held, one
new token each; the scheduler's work at every decode step) and ``DeviceSampler.prepare`` of that many rows (two
samplers a talker step: the main stream and the code predictor's), each the median of ``--repeat`` timings of
``--calls`` calls, in microseconds per call. CPU only: the tensors stay on the host (the device copies that
``prepare`` enqueues on a GPU are not timed). Run it for two trees back to back for a before/after ratio.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

from omni_triton.engine.block_manager import BlockManager
from omni_triton.engine.sampling import DeviceSampler, SamplingParams, TokenHistory
from omni_triton.engine.scheduler import Scheduler
from omni_triton.engine.sequence import Sequence, SequenceStatus

BLOCK_SIZE = 16
CONTEXT = 300  # positions each sequence holds (prompt + generated)


def running_sequences(rows: int) -> tuple[Scheduler, list[Sequence]]:
    """A scheduler with ``rows`` running sequences, each with one pending token (a decode step's state)."""
    scheduler = Scheduler(BlockManager(rows * (CONTEXT // BLOCK_SIZE + 4), BLOCK_SIZE), max(rows, 1) * CONTEXT,
                          max(rows, 1))  # a budget that admits every prompt at once
    params = SamplingParams(temperature=0.9, top_k=50, repetition_penalty=1.05, max_new_tokens=10**6)
    seqs = []
    for i in range(rows):
        seq = Sequence(f"r{i}", params, num_prompt_positions=CONTEXT)
        scheduler.add(seq)
        seqs.append(seq)
    scheduler.schedule()  # admits all: allocates their prompt blocks
    for seq in seqs:
        seq.num_computed_tokens = CONTEXT - 1  # one pending position left: every later schedule is a decode step
    return scheduler, seqs


def time_calls(fn, calls: int, repeat: int) -> float:
    """Median over ``repeat`` runs of ``calls`` calls, microseconds per call."""
    runs = []
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - start) / calls)
    return 1e6 * statistics.median(runs)


def bench(rows: int, calls: int, repeat: int) -> dict:
    scheduler, seqs = running_sequences(rows)
    assert all(seq.status == SequenceStatus.RUNNING for seq in seqs)

    def schedule():
        batch = scheduler.schedule()
        assert len(batch) == rows and batch.num_new_tokens == [1] * rows

    sampler = DeviceSampler(max(rows, 1), "cpu", TokenHistory(max(rows, 1), 4096, "cpu"))
    keys, sample_rows = [seq.request_id for seq in seqs], [seq.sample_row for seq in seqs]
    draws = list(range(rows))
    return {"rows": rows, "schedule_us": time_calls(schedule, calls, repeat),
            "sampler_prepare_us": time_calls(lambda: sampler.prepare(keys, sample_rows, draws), calls, repeat)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8,32,64", help="comma-separated running sequences per step")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--out-dir", type=Path, default=None, help="where host_step.json goes")
    args = parser.parse_args()
    results = [bench(int(r), args.calls, args.repeat) for r in args.rows.split(",")]
    import omni_triton

    print(f"Host bookkeeping per decode step ({omni_triton.__file__}), microseconds per call:")
    print("| rows | Scheduler.schedule | DeviceSampler.prepare |")
    print("|---:|---:|---:|")
    for r in results:
        print(f"| {r['rows']} | {r['schedule_us']:.1f} | {r['sampler_prepare_us']:.1f} |")
    if args.out_dir is not None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / "host_step.json").write_text(json.dumps(
            {"tree": omni_triton.__file__, "machine": platform.processor() or platform.machine(),
             "python": platform.python_version(), "calls": args.calls, "repeat": args.repeat,
             "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
