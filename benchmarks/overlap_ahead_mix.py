"""How many engine steps are launched ahead (``engine/overlap.py``) on a served mix, and why the others are not.

    python benchmarks/overlap_ahead_mix.py                                  # this tree
    git archive main | tar -x -C /tmp/base
    python benchmarks/overlap_ahead_mix.py --baseline-tree /tmp/base       # base and this tree, side by side

Both stages' engines on the serving fast path's host code emulated on the CPU over stub models
(``engine_host_step.py``'s: device samplers, decode and completion graphs whose replays run nothing, overlapped
steps), driven by a closed loop of ``--streams`` clients that each send their next request a few steps after the
last one finished, ``--requests`` in all: prompts of ``PROMPT`` positions, staggered lengths (thinker tokens,
talker frames: uniform in ``--tokens`` / ``--frames``), and for the talker the trailing text arriving while it
decodes, a row every 0.5-1.6 steps in appends of ``TEXT_APPEND`` rows (the thinker's outputs, batched), so a talker
row now and then waits for its text. The step log (``engine/step_log.py``) of every step says whether the step was
launched ahead and, where its successor was not, why (``not_ahead``), the rows a step launched ahead left out
(``left_out``) and those that joined it (``joined``), where the tree has them. Steps, not time: the counts are the same on any machine, with
``overlap_admit`` off (the default) and on. No model runs: what the stubs sample (id 0, never a stop id) makes every
request run to its length.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from collections import Counter
from pathlib import Path

PROMPT = 100
TEXT_APPEND = 4  # text rows per append
STOP_ID = 7


def _host_step_module():
    import importlib.util

    path = Path(__file__).resolve().parent / "engine_host_step.py"
    spec = importlib.util.spec_from_file_location("engine_host_step", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_engine(stage_name: str, streams: int, max_len: int, admit: bool, overlap: bool = True):
    from omni_triton.engine import EngineConfig, LLMEngine
    from omni_triton.engine.stage import TalkerStage, ThinkerStage

    host_step = _host_step_module()
    StubThinker, StubTalker = host_step.stub_models()
    blocks = streams * (-(-(PROMPT + max_len) // 16) + 1) + 4
    tokens = 512
    config = EngineConfig(block_size=16, num_blocks=blocks, max_num_batched_tokens=tokens, max_num_seqs=streams)
    if stage_name == "thinker":
        engine = LLMEngine(ThinkerStage(StubThinker(max(tokens, streams)), accept_hidden_layer=1,
                                        states_past_prompt=False), config)
    else:
        engine = LLMEngine(TalkerStage(StubTalker(max(tokens, streams))), config)
    host_step.emulate_fast_path(engine, streams)
    engine.overlap.admit_ahead = admit
    if not overlap:  # (tests: the synchronous engine's sampler controls)
        engine.overlap, engine._no_overlap = None, "off"
    return engine


def run_mix(stage_name: str, streams: int, requests: int, lengths: tuple[int, int], admit: bool, seed: int,
            overlap: bool = True, min_new_tokens: int = 0) -> dict:
    import torch

    from omni_triton import trace
    from omni_triton.engine import SamplingParams
    from omni_triton.engine.stage import TrailingTextQueue

    engine = make_engine(stage_name, streams, lengths[1], admit, overlap)
    hidden = engine.stage.hidden_size
    row = torch.zeros(hidden)
    next_id, step = 0, 0
    due: list[tuple[int, str]] = []  # (step, what): arrivals ("add") of the closed loop's next requests
    texts: dict[str, list] = {}  # talker request -> [(step, rows, finished), ...] its appends still to come

    def add(at: int) -> None:
        nonlocal next_id
        request_id = f"r{next_id}"
        next_id += 1
        rng = random.Random(f"{seed}-{request_id}")  # a request's own: the same requests however the steps go
        length = rng.randint(*lengths)
        params = SamplingParams(temperature=0.9, top_k=50, repetition_penalty=1.05, max_new_tokens=length,
                                stop_token_ids=(STOP_ID,), min_new_tokens=min(min_new_tokens, length))
        if stage_name == "thinker":
            engine.add_request(request_id, params, prompt_token_ids=[(p * 7 + next_id) % 1000 + 10
                                                                     for p in range(PROMPT)])
            return
        # the thinker's text: about a row for every three frames, arriving from the start, a row every 0.5-1.6
        # steps, appended TEXT_APPEND at a time; the first append comes with the request
        num_rows = max(1, length // 3)
        pace = rng.uniform(0.5, 1.6)
        appends, t = [], float(at)
        for start in range(0, num_rows, TEXT_APPEND):
            n = min(TEXT_APPEND, num_rows - start)
            t += pace * n
            appends.append((int(t), n, start + n == num_rows))
        first = appends.pop(0)
        engine.add_request(request_id, params, prompt_embeds=torch.zeros(PROMPT, hidden),
                           talker_inputs=TrailingTextQueue(row, row))
        engine.append(request_id, trailing_text_embeds=row.expand(first[1], hidden), finished=first[2])
        texts[request_id] = appends

    for i in range(streams):
        due.append((i % 9, "add"))
    finished, sent = 0, streams
    with tempfile.TemporaryDirectory() as directory:
        trace.configure(directory)
        try:
            while finished < requests:
                for item in [d for d in due if d[0] <= step]:
                    due.remove(item)
                    add(step)
                for request_id, appends in list(texts.items()):
                    while appends and appends[0][0] <= step:
                        _, n, done = appends.pop(0)
                        if request_id in engine.requests:
                            engine.append(request_id, trailing_text_embeds=row.expand(n, hidden), finished=done)
                    if not appends:
                        del texts[request_id]
                if engine.has_work():
                    for out in engine.step():
                        if out.finished:
                            finished += 1
                            if sent < requests:  # the client's next request, a few steps later
                                sent += 1
                                due.append((step + 1 + sent % 6, "add"))
                step += 1
                if step > 100_000:
                    raise RuntimeError("the mix did not finish")
        finally:
            trace.configure(None)
        records = trace.read_records(directory, "step")
    return summarize(stage_name, admit, records)


def summarize(stage_name: str, admit: bool, records: list[dict]) -> dict:
    not_ahead = Counter(r["not_ahead"] for r in records if r.get("not_ahead") is not None)
    left_out = Counter()
    for r in records:
        left_out.update(r.get("left_out") or {})
    steps = len(records)
    return {"stage": stage_name, "admit": admit, "steps": steps,
            "ahead_pct": 100 * sum(bool(r["ahead"]) for r in records) / steps,
            "not_ahead_pct": {k: 100 * v / steps for k, v in not_ahead.most_common()},
            "left_out_rows": dict(left_out.most_common()),
            "joined_rows": sum(r.get("joined") or 0 for r in records),
            "decode_rows_mean": sum(r["decode_rows"] for r in records) / steps}


def worker(args) -> dict:
    import torch

    import omni_triton

    torch.set_num_threads(1)
    results = []
    for admit in (False, True):
        for stage in args.stages.split(","):
            lengths = tuple(map(int, (args.tokens if stage == "thinker" else args.frames).split("-")))
            results.append(run_mix(stage, args.streams, args.requests, lengths, admit, args.seed))
    return {"tree": str(Path(omni_triton.__file__).resolve().parents[1]), "results": results}


def run_tree(tree: Path, args) -> dict:
    return _host_step_module().run_worker(Path(__file__), tree, [
        "--stages", args.stages, "--streams", str(args.streams), "--requests", str(args.requests),
        "--tokens", args.tokens, "--frames", args.frames, "--seed", str(args.seed)])


def _reasons(result: dict, top: int = 4) -> str:
    return ", ".join(f"{k} {v:.0f}%" for k, v in list(result["not_ahead_pct"].items())[:top]) or "-"


def table(runs: list[tuple[str, dict]]) -> list[str]:
    lines = ["| tree | stage | overlap_admit | steps | launched ahead % | not ahead: reasons (% of steps) | "
             "rows left out of a step launched ahead | rows joining one |", "|---|---|---|---:|---:|---|---|---:|"]
    for label, run in runs:
        for r in run["results"]:
            left = ", ".join(f"{k} {v}" for k, v in r["left_out_rows"].items()) or "-"
            lines.append(f"| {label} | {r['stage']} | {'on' if r['admit'] else 'off'} | {r['steps']} | "
                         f"{r['ahead_pct']:.0f} | {_reasons(r)} | {left} | {r['joined_rows']} |")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", default="thinker,talker")
    parser.add_argument("--streams", type=int, default=64, help="closed-loop clients (and max_num_seqs)")
    parser.add_argument("--requests", type=int, default=256, help="requests per stage and run")
    parser.add_argument("--tokens", default="20-200", help="thinker max_new_tokens, uniform LOW-HIGH")
    parser.add_argument("--frames", default="30-300", help="talker max_new_tokens (frames), uniform LOW-HIGH")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--baseline-tree", type=Path, default=None, help="another checkout to run as well")
    parser.add_argument("--out", type=Path, default=None, help="a JSON file for the results")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return
    runs = []
    if args.baseline_tree is not None:
        runs.append(("base", run_tree(args.baseline_tree.resolve(), args)))
    runs.append(("branch", run_tree(Path(__file__).resolve().parents[1], args)))
    print("\n".join(table(runs)))
    if args.out is not None:
        args.out.write_text(json.dumps({label: run for label, run in runs}, indent=2) + "\n")


if __name__ == "__main__":
    main()
