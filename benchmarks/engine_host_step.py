"""The engine's host time per decode step, with the model's compute taken out: what the GPU waits on.

    python benchmarks/engine_host_step.py --rows 1,16,64 --out-dir /tmp/engine_host_step
    git worktree add /tmp/base main
    python benchmarks/engine_host_step.py --baseline-tree /tmp/base --rounds 5   # base and this tree, alternately

The served engines (``ThinkerStage`` streaming its accept-layer states as the thinker service asks, of the prompt
only where the tree has ``states_past_prompt``; ``TalkerStage`` with its trailing text)
over stub models that return fixed-shape outputs at once, on the serving fast path's host code, emulated on the
CPU: the device samplers (``DeviceSampler.prepare`` as served; its ``sample`` returns fixed ids), the decode CUDA
graphs (``DecodeGraphs``; a "replay" runs nothing: the graph's outputs are the stub's fixed tensors) and
overlapped steps (``overlap.StepOverlap``: the next step launched before this one is finished). Each engine runs
``rows`` requests into steady decode, then ``--steps`` ``engine.step()`` calls are timed: per step, the whole
call and its parts (``Scheduler.schedule``; the launch: ``ModelRunner.run`` / ``run_ahead``, which build the
step's inputs and prepare the samplers; ``LLMEngine._finish``: tokens to the host, stop checks, outputs, the
stage's bookkeeping), in microseconds of the step thread's CPU time (``time.thread_time``: time spent waiting
for a core on a machine shared with other work is not counted), the least of ``--repeat`` runs. CUDA API calls
(copies, events, the replay's launch) cost host time on a GPU that this CPU run does not see.

``--baseline-tree DIR`` (another checkout, e.g. a ``git worktree`` of main) runs the same workload over that
tree's ``omni_triton`` and this one's, alternating process by process (``--rounds`` each; the host of a small
machine varies from one process to the next), and prints base, branch and branch/base per cell.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HIDDEN = 64  # small on purpose: the stub's tensors must cost next to nothing on the CPU
THINKER_VOCAB, TALKER_VOCAB, CODEBOOKS = 2048, 512, 16
PROMPT = 100  # prompt positions per request
WARM_STEPS = 8
STOP_ID = 7  # never sampled (the stub samples id 0), but looked for
ADMIT_WIDTH = 1024  # the talker's hidden size at full size (Qwen3-Omni-30B-A3B): an admission hashes its prompt rows


def stub_models(talker_hidden: int = HIDDEN):
    """Stand-ins of the thinker and the talker with the call surface the stages use (the talker ``talker_hidden``
    wide: its prompt rows are what an admission hashes for the prefix cache)."""
    import torch
    from torch import nn

    class StubThinker(nn.Module):
        num_layers, num_kv_heads, head_dim, hidden_size, vocab_size = 2, 1, 8, HIDDEN, THINKER_VOCAB

        def __init__(self, max_tokens: int):
            super().__init__()
            self.anchor = nn.Parameter(torch.zeros(1))  # embed_inputs finds the device from a parameter
            self.hidden = torch.zeros(max_tokens, HIDDEN)
            self.logits = torch.zeros(max_tokens, THINKER_VOCAB)

        def embed(self, ids):
            return self.hidden[:ids.shape[0]]

        def forward(self, inputs_embeds, positions, batch, capture_layers=()):
            hidden = self.hidden[:inputs_embeds.shape[0]]
            return hidden, {layer: hidden for layer in capture_layers}

        def compute_logits(self, hidden):
            return self.logits[:hidden.shape[0]]

    class StubTalker(nn.Module):
        num_layers, num_kv_heads, head_dim, hidden_size, vocab_size = 2, 1, 8, talker_hidden, TALKER_VOCAB

        def __init__(self, max_tokens: int):
            super().__init__()
            self.codec_embed = nn.Embedding(1, talker_hidden)
            self.hidden = torch.zeros(max_tokens, talker_hidden)
            self.logits = torch.zeros(max_tokens, TALKER_VOCAB)
            self.codes = torch.zeros(max_tokens, CODEBOOKS, dtype=torch.long)

        def forward(self, inputs_embeds, positions, batch):
            return self.hidden[:inputs_embeds.shape[0]]

        def compute_logits(self, hidden):
            return self.logits[:hidden.shape[0]]

        def predict_frame(self, hidden, token_ids, sample_fn):
            rows = hidden.shape[0]
            return self.codes[:rows], self.hidden[:rows]

    return StubThinker, StubTalker


def emulate_fast_path(engine, max_num_seqs: int) -> None:
    """The fast path's host code on the CPU: device samplers whose draws are fixed ids, decode graphs whose replays
    run nothing, overlapped steps."""
    import torch

    from omni_triton import graph_buckets
    from omni_triton.engine import runner as runner_module
    from omni_triton.engine.overlap import StepOverlap
    from omni_triton.engine.sampling import DeviceSampler, TokenHistory

    fixed_ids = torch.zeros(max_num_seqs, dtype=torch.long)
    DeviceSampler.sample = lambda self, logits, group=0, general=False: fixed_ids[:logits.shape[0]]

    class NoReplay:
        def replay(self):
            pass

    def capture_buckets(buckets, body, graphs, outputs, pool=None):
        for bucket in buckets:
            outputs[bucket] = body(bucket)
            graphs[bucket] = NoReplay()
        return pool

    for module in list(sys.modules.values()):  # wherever the engine imported it by name
        if getattr(module, "capture_buckets", None) is graph_buckets.capture_buckets and module is not graph_buckets:
            module.capture_buckets = capture_buckets
    runner = engine.runner
    history = TokenHistory(max_num_seqs, runner.stage.model.vocab_size, runner.device)
    runner.samplers = {name: DeviceSampler(max_num_seqs, runner.device,
                                           history if name == runner_module.MAIN_STREAM else None)
                       for name in runner.streams}
    runner.graphs = runner_module.DecodeGraphs(runner, max_num_seqs)
    engine.overlap = StepOverlap(engine.scheduler, engine.block_manager, runner, max_num_seqs)
    engine._no_overlap = None


def make_engine(stage_name: str, rows: int, steps: int):
    import torch

    from omni_triton.engine import EngineConfig, LLMEngine, SamplingParams
    from omni_triton.engine.stage import TalkerStage, ThinkerStage, TrailingTextQueue

    StubThinker, StubTalker = stub_models()
    max_new_tokens = WARM_STEPS + steps + 4
    positions = PROMPT + max_new_tokens
    blocks = rows * (-(-positions // 16) + 1) + 4
    config = EngineConfig(block_size=16, num_blocks=blocks, max_num_batched_tokens=max(rows * PROMPT, 512),
                          max_num_seqs=rows)
    if stage_name == "thinker":
        # as the thinker service makes it: streaming its prompt's states only, where the tree can
        served = ({"states_past_prompt": False}
                  if "states_past_prompt" in inspect.signature(ThinkerStage).parameters else {})
        engine = LLMEngine(ThinkerStage(StubThinker(max(rows * PROMPT, 512)), accept_hidden_layer=1, **served),
                           config)
        params = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, repetition_penalty=1.05,
                                max_new_tokens=max_new_tokens, stop_token_ids=(STOP_ID,))
    else:
        engine = LLMEngine(TalkerStage(StubTalker(max(rows * PROMPT, 512))), config)
        params = SamplingParams(temperature=0.9, top_k=50, repetition_penalty=1.05, max_new_tokens=max_new_tokens,
                                stop_token_ids=(STOP_ID,))
    emulate_fast_path(engine, rows)
    for i in range(rows):
        if stage_name == "thinker":
            engine.add_request(f"r{i}", params, prompt_token_ids=[(i + p) % 1000 + 10 for p in range(PROMPT)])
        else:
            text = torch.zeros(HIDDEN)
            engine.add_request(f"r{i}", params, prompt_embeds=torch.zeros(PROMPT, HIDDEN),
                               talker_inputs=TrailingTextQueue(text, text), thinker_finished=True)
    return engine


class PartTimer:
    """Adds up the time spent in a few methods of one engine (patched on the instances)."""

    def __init__(self, engine):
        self.seconds = {"schedule": 0.0, "launch": 0.0, "finish": 0.0}
        self._wrap(engine.scheduler, "schedule", "schedule")
        self._wrap(engine.runner, "run", "launch")
        self._wrap(engine.runner, "run_ahead", "launch")
        self._wrap(engine, "_finish", "finish")

    def _wrap(self, owner, method: str, part: str) -> None:
        inner = getattr(owner, method)

        def timed(*args, **kwargs):
            start = time.thread_time()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[part] += time.thread_time() - start

        setattr(owner, method, timed)

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.seconds, 0.0)


def measure(stage_name: str, rows: int, steps: int, repeat: int) -> dict:
    """The least disturbed of ``repeat`` runs of ``steps`` decode steps each (the minimum: other processes only
    add time): microseconds per step, whole and by part."""
    runs = []
    for _ in range(repeat):
        engine = make_engine(stage_name, rows, steps)
        for _ in range(WARM_STEPS):  # the prefill, then decode steps until the overlap runs steadily
            engine.step()
        timer = PartTimer(engine)
        start = time.thread_time()
        for _ in range(steps):
            outputs = engine.step()
            assert len(outputs) == rows, f"{stage_name}: {len(outputs)} outputs for {rows} rows"
        total = time.thread_time() - start
        assert engine.overlap.launched >= steps - 1, "steps were not overlapped: not the served steady state"
        runs.append({"step_us": total, **timer.seconds})
    return {"stage": stage_name, "rows": rows,
            **{key: 1e6 * min(run[key] for run in runs) / steps for key in runs[0]}}


def measure_admissions(rows: int, admissions: int, repeat: int) -> dict:
    """The talker as served (prefix caching on, prompts ``ADMIT_WIDTH`` wide in bf16, each its own values): ``rows``
    requests decoding steadily; then, ``admissions`` times, one of them ends and a new one is added, as the talker
    service hands it over (its prompt's keys made on the caller's thread where the tree takes them:
    ``prompt_keys``), and the engine steps until the new one decodes with the others. Per admission, in
    microseconds of the step thread's CPU time, the least of ``repeat`` runs: applying the add (``add_request``),
    the steps that carried its prefill rows (not launched ahead), and a steady decode step beside them."""
    import torch

    from omni_triton.engine import EngineConfig, LLMEngine, SamplingParams
    from omni_triton.engine.prefix_cache import embedding_keys
    from omni_triton.engine.stage import TalkerStage, TrailingTextQueue

    _, StubTalker = stub_models(ADMIT_WIDTH)
    takes_keys = "prompt_keys" in inspect.signature(TalkerStage.init_sequence).parameters
    steps_each = 4  # steady steps after an admission's prefill, timed as the steady step
    max_new_tokens = WARM_STEPS + admissions * (steps_each + 4) + 8
    blocks = (rows + admissions + 2) * (-(-(PROMPT + max_new_tokens) // 16) + 1)
    params = SamplingParams(temperature=0.9, top_k=50, repetition_penalty=1.05, max_new_tokens=max_new_tokens,
                            stop_token_ids=(STOP_ID,))
    text = torch.zeros(ADMIT_WIDTH, dtype=torch.bfloat16)
    runs = []
    for _ in range(repeat):
        config = EngineConfig(block_size=16, num_blocks=blocks, max_num_batched_tokens=max(rows * PROMPT, 512),
                              max_num_seqs=rows + 1, prefix_caching=True)
        engine = LLMEngine(TalkerStage(StubTalker(max(rows * PROMPT, 512))), config)
        emulate_fast_path(engine, rows + 1)
        generator = torch.Generator().manual_seed(0)

        def request(index: int) -> tuple[str, dict]:
            prompt = torch.randn(PROMPT, ADMIT_WIDTH, generator=generator).to(torch.bfloat16)
            inputs = dict(prompt_embeds=prompt, talker_inputs=TrailingTextQueue(text, text), thinker_finished=True)
            if takes_keys:  # made on the service's thread, as served: not the engine thread's time
                inputs["prompt_keys"] = embedding_keys(prompt)
            return f"r{index}", inputs

        for index in range(rows):
            request_id, inputs = request(index)
            engine.add_request(request_id, params, **inputs)
        for _ in range(WARM_STEPS):
            engine.step()
        add_s = prefill_s = steady_s = 0.0
        steady_steps = 0
        for admission in range(admissions):
            engine.abort(f"r{admission}")  # one ends (untimed), one comes
            request_id, inputs = request(rows + admission)
            start = time.thread_time()
            engine.add_request(request_id, params, **inputs)
            add_s += time.thread_time() - start
            seq = engine.requests[request_id]
            start = time.thread_time()
            while seq.num_computed_tokens < seq.num_prompt_positions:
                engine.step()
            prefill_s += time.thread_time() - start
            for _ in range(steps_each):
                start = time.thread_time()
                engine.step()
                steady_s += time.thread_time() - start
                steady_steps += 1
        runs.append({"add_us": 1e6 * add_s / admissions, "prefill_steps_us": 1e6 * prefill_s / admissions,
                     "steady_step_us": 1e6 * steady_s / steady_steps})
    return {"stage": "talker admissions", "rows": rows, **{key: min(run[key] for run in runs) for key in runs[0]}}


def worker(args) -> dict:
    import torch

    import omni_triton

    torch.set_num_threads(1)
    if args.admissions:
        results = [measure_admissions(rows, args.admissions, args.repeat) for rows in map(int, args.rows.split(","))]
    else:
        results = [measure(stage, rows, args.steps, args.repeat)
                   for stage in args.stages.split(",") for rows in map(int, args.rows.split(","))]
    return {"tree": str(Path(omni_triton.__file__).resolve().parents[1]), "results": results}


STEP_PARTS = ("step_us", "schedule", "launch", "finish")
ADMISSION_PARTS = ("add_us", "prefill_steps_us", "steady_step_us")


def parts_of(results: list[dict]) -> tuple[str, ...]:
    return ADMISSION_PARTS if "add_us" in results[0] else STEP_PARTS


def table(results: list[dict]) -> list[str]:
    parts = parts_of(results)
    lines = ["| stage | rows | " + " | ".join(p.removesuffix("_us") for p in parts) + " |",
             "|---|---:|" + "---:|" * len(parts)]
    for r in results:
        lines.append(f"| {r['stage']} | {r['rows']} | " + " | ".join(f"{r[p]:.1f}" for p in parts) + " |")
    return lines


def compare_table(base: list[dict], branch: list[dict]) -> list[str]:
    parts = parts_of(base)
    lines = ["| stage | rows | " + " | ".join(f"{p.removesuffix('_us')} base / branch / ratio" for p in parts) + " |",
             "|---|---:|" + "---:|" * len(parts)]
    for b, r in zip(base, branch):
        cells = [f"{b[p]:.1f} / {r[p]:.1f} / {r[p] / b[p]:.2f}" if b[p] else "-" for p in parts]
        lines.append(f"| {r['stage']} | {r['rows']} | " + " | ".join(cells) + " |")
    return lines


def run_tree(tree: Path, args) -> dict:
    return run_worker(Path(__file__), tree, ["--rows", args.rows, "--stages", args.stages, "--steps", str(args.steps),
                                             "--repeat", str(args.repeat), "--admissions", str(args.admissions)])


def run_worker(script: Path, tree: Path, worker_args: list[str]) -> dict:
    """``script --worker worker_args`` in a process of its own over ``tree``'s omni_triton (``-P``: the script's
    folder is not on the path), and the JSON line it prints last."""
    command = [sys.executable, "-P", str(script.resolve()), "--worker", *worker_args]
    done = subprocess.run(command, env={**os.environ, "PYTHONPATH": str(tree)}, check=True, stdout=subprocess.PIPE,
                          text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def median_results(runs: list[dict]) -> list[dict]:
    merged = []
    for cells in zip(*(run["results"] for run in runs)):
        merged.append({**cells[0], **{p: statistics.median(c[p] for c in cells) for p in parts_of(list(cells))}})
    return merged


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,16,64", help="comma-separated decode rows per step")
    parser.add_argument("--stages", default="thinker,talker")
    parser.add_argument("--steps", type=int, default=200, help="timed decode steps per run")
    parser.add_argument("--repeat", type=int, default=3, help="runs per cell in one process (the least)")
    parser.add_argument("--admissions", type=int, default=0,
                        help="time this many talker admissions per run instead of decode steps (prefix caching on)")
    parser.add_argument("--baseline-tree", type=Path, default=None, help="a checkout to compare with, alternately")
    parser.add_argument("--rounds", type=int, default=3, help="with --baseline-tree: processes per tree")
    parser.add_argument("--out-dir", type=Path, default=None, help="where engine_host_step.json goes")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return
    this_tree = Path(__file__).resolve().parents[1]
    report = {"machine": platform.processor() or platform.machine(), "python": platform.python_version(),
              "steps": args.steps, "repeat": args.repeat}
    what = "talker admission" if args.admissions else "decode step"
    print(f"Engine host time per {what} (stub models, fast path emulated on the CPU), microseconds:")
    if args.baseline_tree is None:
        run = run_tree(this_tree, args)
        report.update(tree=run["tree"], results=run["results"])
        print(f"tree {run['tree']}")
        print("\n".join(table(run["results"])))
    else:
        base_runs, branch_runs = [], []
        for _ in range(args.rounds):
            base_runs.append(run_tree(args.baseline_tree.resolve(), args))
            branch_runs.append(run_tree(this_tree, args))
        base, branch = median_results(base_runs), median_results(branch_runs)
        report.update(base_tree=base_runs[0]["tree"], branch_tree=branch_runs[0]["tree"], rounds=args.rounds,
                      base=base, branch=branch, base_runs=base_runs, branch_runs=branch_runs)
        print(f"base {base_runs[0]['tree']} vs branch {branch_runs[0]['tree']}, medians of {args.rounds} processes "
              "each, alternating")
        print("\n".join(compare_table(base, branch)))
    if args.out_dir is not None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / "engine_host_step.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
