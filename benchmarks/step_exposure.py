"""Decode-step wall time against its CUDA graph's GPU time: how much host work the GPU waits on per step.

    python -P benchmarks/step_exposure.py TAG --out-dir DIR     # on the GPU machine, from the repository root
    PYTHONPATH=<other tree> python -P benchmarks/step_exposure.py TAG ...   # the same steps on another tree

Full Qwen3-Omni-30B-A3B dimensions, seeded random bf16 weights (``dummy`` load), the serving fast path
(``engine_microbench``'s ``pdl`` variant), served sampling. Per stage and batch: requests with 108-token prompts
(thinker) or 128 prompt positions (talker) run to their first token, 20 warm steps, then 300 steps timed: step
wall p50 (``engine.step()``, which reads its sampled ids back) and the decode graph's replay time p50 (CUDA
events around each replay); wall - GPU is the host work not hidden behind the GPU (scheduling, input
preparation before the replay; the eager sampling after the graph for the thinker, the read-back). ``-P``
keeps the script's folder off sys.path, so PYTHONPATH picks the tree measured. Interleave two trees' runs
(A B A B): the host side of this machine varies by 10-40% from one process to the next. ``--overlap-steps``:
on (the default): the thinker launches each decode step before the last one's ids are read
(``engine/overlap.py``), so its step wall is about max(GPU, host) a step; off: synchronous steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types
from pathlib import Path

import torch

sys.path.insert(0, "benchmarks")
import engine_microbench as mb  # noqa: E402
import omni_triton  # noqa: E402
from omni_triton.engine import ThinkerStage  # noqa: E402
from omni_triton.models.weights import load_talker, load_thinker  # noqa: E402

STEPS = 300


class TimedGraph:
    """A captured graph whose replays are bracketed by CUDA events."""

    def __init__(self, graph, log):
        self.graph, self.log = graph, log

    def replay(self):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self.graph.replay()
        end.record()
        self.log.append((start, end))


def measure(args, stage_name: str, model, batch: int) -> dict:
    stage = ThinkerStage(model) if stage_name == "thinker" else mb.talker_stage(model, args)
    engine = mb.make_engine(stage, model, args, max(batch, 8), 128 + 900, "pdl")
    params = mb.sampling_params("served", stage_name, 800)
    gen = torch.Generator().manual_seed(1)
    for i in range(batch):
        if stage_name == "thinker":
            prompt = torch.randint(0, model.config.text.vocab_size, (108,), generator=gen).tolist()
            engine.add_request(f"r{i}", params, prompt_token_ids=prompt)
        else:
            prompt = torch.randn(128, model.hidden_size, generator=gen).to(args.device, args.dtype)
            engine.add_request(f"r{i}", params, prompt_embeds=prompt, thinker_finished=True)
    while any(seq.num_generated == 0 for seq in engine.requests.values()):
        engine.step()
    for _ in range(20):
        engine.step()
    log: list = []
    engine.runner.graphs.graphs = {k: TimedGraph(g, log) for k, g in engine.runner.graphs.graphs.items()}
    wall = []
    for _ in range(STEPS):
        start = time.perf_counter()
        engine.step()
        wall.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    wall_ms, gpu_ms = 1e3 * statistics.median(wall), statistics.median(s.elapsed_time(e) for s, e in log)
    print(f"{args.tag} {stage_name} b{batch}: step wall p50 {wall_ms:.4f} ms, graph GPU p50 {gpu_ms:.4f} ms, "
          f"exposed host {wall_ms - gpu_ms:.4f} ms", flush=True)
    del engine
    torch.cuda.empty_cache()
    return {"stage": stage_name, "batch": batch, "step_wall_p50_ms": wall_ms, "graph_gpu_p50_ms": gpu_ms,
            "exposed_host_ms": wall_ms - gpu_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tag", help="names this run in the output (e.g. before1, after1)")
    parser.add_argument("--thinker-batches", default="1,32")
    parser.add_argument("--talker-batches", default="1,64")
    parser.add_argument("--out-dir", type=Path, default=None, help="where step_exposure_TAG.json goes")
    parser.add_argument("--overlap-steps", choices=["on", "off"], default="on",
                        help="EngineConfig.overlap_steps: the thinker launches its next step before reading the "
                             "last one's ids (default: %(default)s)")
    cli = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("step_exposure.py times CUDA graph replays: it needs a CUDA GPU")
    args = types.SimpleNamespace(device="cuda", dtype=torch.bfloat16, max_num_batched_tokens=2048, tag=cli.tag,
                                 config_dir=mb.config_dir(mb.FULL_SIZE_CONFIG, 0), talker_prompt_len=128,
                                 sampling="served", overlap_steps=cli.overlap_steps == "on")
    print(cli.tag, "omni_triton from", omni_triton.__file__, flush=True)
    rows = []
    for stage_name, batches, load in (("thinker", cli.thinker_batches, lambda: load_thinker(
            args.config_dir, "cuda", args.dtype, with_audio=False, load_format="dummy")),
                                      ("talker", cli.talker_batches, lambda: load_talker(
            args.config_dir, "cuda", args.dtype, load_format="dummy"))):
        if not batches:
            continue
        model = load()
        rows += [measure(args, stage_name, model, int(b)) for b in batches.split(",") if b]
        del model
        torch.cuda.empty_cache()
    if cli.out_dir is not None:
        cli.out_dir.mkdir(parents=True, exist_ok=True)
        (cli.out_dir / f"step_exposure_{cli.tag}.json").write_text(json.dumps(
            {"tag": cli.tag, "tree": omni_triton.__file__, "overlap_steps": cli.overlap_steps == "on", "device": torch.cuda.get_device_name(),
             "torch": torch.__version__, "steps": STEPS, "results": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
