"""Where a decode step's time goes under its CUDA graph: every kernel the graph replays, with its start and end.

``engine_microbench.py --profile`` shows eager steps (each launch visible, but eager steps run other kernels than
the graph: the attention plan's gathers and scatters, host-built tensors). This replays the serving form (the
``pdl`` variant: fast path, CUDA graphs, dependent launch) and asks the profiler for the kernels inside the
replays, so what it prints is what a served step runs:

    python benchmarks/graph_timeline.py --device cuda --stages talker,thinker --batch-sizes 1,64 --out-dir OUT

Per stage and batch: kernels per step, the step's span on the GPU (first kernel's start to the last one's end),
the time at least one kernel ran (the union of their intervals: span minus it is time the GPU sat between
kernels), and the kernels by total time. The talker's step is also split where the code predictor starts (its
first ``_frame_attention_kernel``'s predecessor): talker layers, then 15 predictor steps. Each step's timeline
goes to ``<out-dir>/graph_timeline_<stage>_b<batch>.json`` ([name, start us, end us] per kernel).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_microbench import (DECODE_STEPS, config_dir, make_engine, sampling_params, sync,  # noqa: E402
                               talker_stage)

from omni_triton.engine import ThinkerStage  # noqa: E402
from omni_triton.models.weights import load_talker, load_thinker  # noqa: E402

PROFILED_STEPS = 3
PREDICTOR_MARK = "_frame_attention_kernel"


def step_kernels(engine, device: torch.device) -> list[list[tuple[str, float, float]]]:
    """[(name, start us, end us)] of each of ``PROFILED_STEPS`` engine steps, in start order."""
    from torch.profiler import ProfilerActivity, profile

    steps = []
    for _ in range(PROFILED_STEPS):
        sync(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            engine.step()
            sync(device)
        kernels = sorted(((e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                          if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith("Memcpy")),
                         key=lambda kernel: kernel[1])
        origin = kernels[0][1] if kernels else 0
        steps.append([(name, start - origin, end - origin) for name, start, end in kernels])
    return steps


def busy_us(kernels: list[tuple[str, float, float]]) -> float:
    """Time at least one kernel ran (intervals overlap under dependent launch)."""
    total, reach = 0.0, float("-inf")
    for _, start, end in kernels:
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def span_us(kernels: list[tuple[str, float, float]]) -> float:
    """First start to latest end (under dependent launch the last kernel to start may end before another)."""
    return max(end for _, _, end in kernels) - kernels[0][1] if kernels else 0.0


def summarize(label: str, kernels: list[tuple[str, float, float]]) -> dict:
    span = span_us(kernels)
    by_name: dict[str, list[float]] = defaultdict(list)
    for name, start, end in kernels:
        by_name[name].append(end - start)
    top = sorted(((sum(d), len(d), name) for name, d in by_name.items()), reverse=True)
    return dict(label=label, kernels=len(kernels), span_us=span, busy_us=busy_us(kernels),
                top=[dict(name=name[:80], calls=calls, total_us=total, mean_us=total / calls)
                     for total, calls, name in top[:12]])


def print_summary(summary: dict) -> None:
    print(f"\n--- {summary['label']}: {summary['kernels']} kernels, span {summary['span_us']:.0f} us, "
          f"a kernel running {summary['busy_us']:.0f} us ({summary['span_us'] - summary['busy_us']:.0f} us idle)")
    print(f"{'kernel':<80} {'calls':>6} {'total us':>9} {'mean us':>8}")
    for row in summary["top"]:
        print(f"{row['name']:<80} {row['calls']:>6} {row['total_us']:>9.1f} {row['mean_us']:>8.2f}")


def split_talker(kernels: list[tuple[str, float, float]]) -> tuple[list, list]:
    """(talker layers and sampling, code predictor) of one talker frame."""
    for i, (name, _, _) in enumerate(kernels):
        if name == PREDICTOR_MARK:
            return kernels[:i - 1], kernels[i - 1:]
    return kernels, []


def profile_stage(stage_name: str, args, batches: list[int], out: Path) -> list[dict]:
    device = torch.device(args.device)
    loader = load_thinker if stage_name == "thinker" else load_talker
    kwargs = dict(with_audio=False) if stage_name == "thinker" else {}
    model = loader(args.config_dir, device, args.dtype, load_format="dummy", **kwargs)
    generator = torch.Generator().manual_seed(0)
    params = sampling_params(args.sampling, stage_name, DECODE_STEPS + 1)
    summaries = []
    for batch in batches:
        stage = ThinkerStage(model) if stage_name == "thinker" else talker_stage(model, args)
        engine = make_engine(stage, model, args, batch, args.prompt_len + DECODE_STEPS + 2, "pdl")
        for i in range(batch):
            if stage_name == "thinker":
                prompt = torch.randint(0, model.config.text.vocab_size, (args.prompt_len,), generator=generator)
                engine.add_request(str(i), params, prompt_token_ids=prompt.tolist())
            else:
                prompt = torch.randn(args.prompt_len, model.hidden_size, generator=generator)
                engine.add_request(str(i), params, prompt_embeds=prompt.to(device, args.dtype), thinker_finished=True)
        while any(seq.num_generated < 4 for seq in engine.requests.values()):  # past the prefill, graphs warm
            engine.step()
        steps = step_kernels(engine, device)
        while engine.has_work():
            engine.step()
        (out / f"graph_timeline_{stage_name}_b{batch}.json").write_text(json.dumps(steps) + "\n")
        last = steps[-1]
        parts = [(f"{stage_name} decode step, batch {batch}", last)]
        if stage_name == "talker":
            talker_part, predictor_part = split_talker(last)
            parts += [(f"  of it: talker layers + sampling, batch {batch}", talker_part),
                      (f"  of it: 15 code-predictor steps, batch {batch}", predictor_part)]
        for label, kernels in parts:
            summary = summarize(label, kernels)
            print_summary(summary)
            summaries.append(summary)
        print(f"spans of the {PROFILED_STEPS} profiled steps (us): {', '.join(f'{span_us(s):.0f}' for s in steps)}")
        del engine
    del model
    torch.cuda.empty_cache()
    return summaries


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="qwen3_omni_30b_a3b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--stages", default="talker,thinker")
    parser.add_argument("--batch-sizes", default="1,64")
    parser.add_argument("--sampling", default="served", choices=["greedy", "served"],
                        help="greedy rows, or the served defaults' sampling (engine_microbench.sampling_params)")
    parser.add_argument("--prompt-len", type=int, default=108)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--out-dir", default=".")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or torch.device(args.device).type != "cuda":
        parser.error("graph_timeline profiles CUDA graph replays: it needs a CUDA device")
    args.dtype = torch.bfloat16
    args.config_dir = config_dir(args.config, 0)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, config=args.config,
                  sampling=args.sampling,
                  command="python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]))
    for stage_name in args.stages.split(","):
        result[stage_name] = profile_stage(stage_name, args, batches, out)
        (out / "graph_timeline.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out / 'graph_timeline.json'}")


if __name__ == "__main__":
    main()
