"""Code2Wav time per streamed chunk: stateful (new frames only) vs 25 frames of left context vs the exact context.

    python benchmarks/code2wav_state_bench.py --device cuda --dtype bfloat16 --config qwen3_omni_30b_a3b \
        --out-dir benchmarks/results/h200-code2wav-state
    python benchmarks/code2wav_state_bench.py --config tiny --batch-sizes 1,2      # CPU smoke run
    ... --cudnn-autotune on        # cuda: cuDNN times its convolution algorithms (serve's default)

Per batch size (default 1, 8, 32, 64), one later chunk of ``--chunk-frames`` (25) new frames per stream, each way
the code2wav stage can decode it, all eager (no CUDA graphs), seeded random weights with the dims of ``--config``:

- stateful: the stage's own path, ``Code2WavStreamStates.decode`` (gather each stream's state slot, decode the new
  frames with ``decode_stream``, write the state back), streams already past their first chunks;
- context 25: one stateless decode of 25 + 25 frames (``--left-context-frames 25``: inexact audio);
- exact: one stateless decode of 25 + ``exact_left_context_frames`` frames (578 at full size);
- stateful graph (CUDA only): the stateful path with the torch runtime's CUDA graphs (``--cuda-graphs on``: the
  stage replays stream chunks of up to 32 frames from graphs, batch padded to a bucket).

Also, at batch 1: the stateful stream of the 4/8/24/25 ramp against a one-pass decode of the same frames (max
abs error; bf16 rounding at full size). Prints a markdown table; writes code2wav_state_bench.json and .md.

``--profile-batch N``: then one stateful call at batch N (eager) under torch.profiler: its ops by time on the
device (CPU time where there is no GPU), into code2wav_profile.txt: where a served code2wav call's time goes (at 64
streams on an H200 the stage was busy 86-93% of the wall, its calls of ~5 chunks taking ~20 ms on the GPU).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

from engine_microbench import config_dir, timed
from omni_triton.models.code2wav.vocoder import exact_left_context_frames
from omni_triton.models.code2wav.graphs import GraphSettings
from omni_triton.models.code2wav.runtime import Code2WavRuntime
from omni_triton.pipeline.code2wav.stream_states import Code2WavStreamStates, StreamChunk

RAMP = [4, 8, 24, 25]
CONTEXT_25 = 25


def stream_store(runtime: Code2WavRuntime, slots: int) -> Code2WavStreamStates:
    return Code2WavStreamStates(runtime.decode_stream, runtime.state_specs(), runtime.streaming_samples,
                                runtime.device, initial_slots=slots)


def random_codes(runtime: Code2WavRuntime, batch: int, frames: int, generator: torch.Generator) -> torch.Tensor:
    config = runtime.config
    return torch.randint(0, config.codebook_size, (batch, config.num_quantizers, frames),
                         generator=generator).to(runtime.device)


@torch.inference_mode()
def ramp_error(runtime: Code2WavRuntime, generator: torch.Generator) -> dict:
    """Stateful ramp vs one pass at batch 1: max abs error, and the reference's std (the error's scale)."""
    codes = random_codes(runtime, 1, sum(RAMP), generator)
    states, pieces, done = stream_store(runtime, 1), [], 0
    for index, frames in enumerate(RAMP):
        (samples,) = states.decode([StreamChunk("ramp", codes[0, :, done:done + frames], first=index == 0)])
        pieces.append(samples)
        done += frames
    reference = runtime.decode(codes)[0]
    streamed = torch.cat(pieces)
    if streamed.shape != reference.shape:
        raise RuntimeError(f"stateful ramp gave {tuple(streamed.shape)} samples, one pass {tuple(reference.shape)}")
    return dict(frames=RAMP, max_abs_error=(streamed - reference).abs().max().item(),
                reference_std=reference.std().item(), clamped_fraction=(reference.abs() >= 1.0).float().mean().item())


def stateful_call(runtime: Code2WavRuntime, batch: int, chunk: int, generator: torch.Generator):
    """The stage's decode of one later chunk per stream, streams already past their first chunks."""
    states = stream_store(runtime, batch)
    ids = [f"s{i}" for i in range(batch)]
    warm = random_codes(runtime, batch, 2 * chunk, generator)
    states.decode([StreamChunk(sid, warm[i, :, :4], first=True) for i, sid in enumerate(ids)])
    states.decode([StreamChunk(sid, warm[i, :, 4:], first=False) for i, sid in enumerate(ids)])
    new = random_codes(runtime, batch, chunk, generator)
    chunks = [StreamChunk(sid, new[i], first=False) for i, sid in enumerate(ids)]
    return lambda: states.decode(chunks)


@torch.inference_mode()
def time_batch(runtime: Code2WavRuntime, graph_runtime: Code2WavRuntime | None, batch: int, chunk: int, exact: int,
               generator: torch.Generator) -> dict:
    device = runtime.device
    row = dict(batch=batch)
    cases = (("stateful_ms", stateful_call(runtime, batch, chunk, generator)),
             ("context25_ms", lambda codes=random_codes(runtime, batch, CONTEXT_25 + chunk, generator):
              runtime.decode(codes)),
             ("exact_ms", lambda codes=random_codes(runtime, batch, exact + chunk, generator): runtime.decode(codes)))
    if graph_runtime is not None:
        cases += (("stateful_graph_ms", stateful_call(graph_runtime, batch, chunk, generator)),)
    for name, call in cases:
        try:
            row[name] = 1e3 * timed(call, device)
        except torch.OutOfMemoryError:
            row[name] = None
        if device.type == "cuda":
            torch.cuda.empty_cache()
    for other in ("context25", "exact"):
        if row["stateful_ms"] and row[f"{other}_ms"]:
            row[f"stateful_over_{other}"] = row["stateful_ms"] / row[f"{other}_ms"]
    return row


@torch.inference_mode()
def profile_call(runtime: Code2WavRuntime, batch: int, chunk: int, generator: torch.Generator) -> str:
    """One stateful call at ``batch`` (after a warm-up call) under torch.profiler: the ops' table, slowest first."""
    from torch.profiler import ProfilerActivity, profile

    call = stateful_call(runtime, batch, chunk, generator)
    call()
    on_gpu = runtime.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities, record_shapes=True) as prof:
        call()
        if on_gpu:
            torch.cuda.synchronize(runtime.device)
    sort_by = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    autotune = f", cuDNN autotune {'on' if torch.backends.cudnn.benchmark else 'off'}" if on_gpu else ""
    return (f"One stateful call, batch {batch}, {chunk} new frames a stream, eager{autotune}, ops by {sort_by}:\n"
            + prof.key_averages().table(sort_by=sort_by, row_limit=30, max_name_column_width=50)
            + "\n\nThe same, by input shapes (which convolution is which):\n"
            + prof.key_averages(group_by_input_shape=True).table(sort_by=sort_by, row_limit=25,
                                                                 max_name_column_width=40, max_shapes_column_width=90))


def markdown(result: dict) -> str:
    ramp = result["ramp"]
    lines = [f"Device: {result['device_name']}; {result['config']} Code2Wav (random {result['dtype']} weights); "
             f"torch {result['torch']}; cuDNN autotune {result['cudnn_autotune']}, dilated phases "
             f"{result['dilated_phases']}, Triton SnakeBeta {result['triton_snake']}.", "",
             f"Command: `{result['command']}`", "",
             f"One later chunk of {result['chunk_frames']} new frames per stream, eager: stateful (the stage's "
             f"state slots + decode of the new frames), context 25 ({CONTEXT_25} + {result['chunk_frames']} frames), "
             f"exact ({result['exact_left_context_frames']} + {result['chunk_frames']} frames):", "",
             "| batch | stateful ms | context 25 ms | exact ms | stateful / context 25 | stateful / exact | "
             "stateful graph ms |", "|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['batch']} | {_num(r['stateful_ms'])} | {_num(r['context25_ms'])} | {_num(r['exact_ms'])} | "
              f"{_num(r.get('stateful_over_context25'))} | {_num(r.get('stateful_over_exact'), 3)} | "
              f"{_num(r.get('stateful_graph_ms'))} |" for r in result["rows"]]
    lines += ["", f"Stateful ramp {ramp['frames']} vs one pass (batch 1): max abs error {ramp['max_abs_error']:.2e}, "
              f"reference std {ramp['reference_std']:.3f}, {100 * ramp['clamped_fraction']:.1f}% of samples at the "
              "+-1 clamp."]
    return "\n".join(lines) + "\n"


def _num(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="qwen3_omni_30b_a3b", help="shipped config name, 'tiny', or checkpoint dir")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--batch-sizes", default="1,8,32,64")
    parser.add_argument("--chunk-frames", type=int, default=25)
    parser.add_argument("--threads", type=int, default=2, help="CPU threads for torch")
    parser.add_argument("--out-dir", default=".")
    parser.add_argument("--cudnn-autotune", choices=["on", "off"], default="off",
                        help="cuda: cuDNN times its convolution algorithms per shape (serve's "
                             "--code2wav-cudnn-autotune; default: %(default)s, cuDNN's heuristic)")
    parser.add_argument("--dilated-phases", choices=["on", "off"], default="off",
                        help="cuda: dilated convolutions over the input's phases (serve's --code2wav-dilated-phases)")
    parser.add_argument("--triton-snake", choices=["on", "off"], default="off",
                        help="cuda: SnakeBeta as one fused Triton kernel (serve's --code2wav-triton-snake; "
                             "default: %(default)s, torch's elementwise ops)")
    parser.add_argument("--profile-batch", type=int, metavar="N",
                        help="also profile one stateful call at batch N (code2wav_profile.txt)")
    args = parser.parse_args(argv)
    if args.profile_batch is not None and args.profile_batch < 1:
        parser.error(f"--profile-batch must be >= 1, got {args.profile_batch}")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    source = dict(device=device, dtype=getattr(torch, args.dtype), load_format="dummy",
                  cudnn_autotune=args.cudnn_autotune == "on", dilated_phases=args.dilated_phases == "on",
                  triton_snake=args.triton_snake == "on")
    runtime = Code2WavRuntime.create("torch", config_dir(args.config, 0), **source)
    # same seeded weights; graphs of every bucket up to the largest batch, captured on first use
    graph_runtime = (Code2WavRuntime.create("torch", config_dir(args.config, 0), **source, cuda_graphs=True,
                                            graph_settings=GraphSettings(max_batch=max(batches),
                                                                         max_frames=max(32, args.chunk_frames)))
                     if device.type == "cuda" else None)
    exact = exact_left_context_frames(runtime.config)
    generator = torch.Generator().manual_seed(0)
    result = dict(device_name=torch.cuda.get_device_name() if device.type == "cuda" else platform.processor(),
                  config=args.config, dtype=args.dtype, torch=torch.__version__, chunk_frames=args.chunk_frames,
                  cudnn_autotune=args.cudnn_autotune, dilated_phases=args.dilated_phases,
                  triton_snake=args.triton_snake,
                  exact_left_context_frames=exact,
                  command="python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
                  ramp=ramp_error(runtime, generator), rows=[])
    for batch in batches:
        result["rows"].append(time_batch(runtime, graph_runtime, batch, args.chunk_frames, exact, generator))
        print(markdown(result), flush=True)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "code2wav_state_bench.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "code2wav_state_bench.md").write_text(markdown(result))
    print(f"wrote {out / 'code2wav_state_bench.json'} and {out / 'code2wav_state_bench.md'}")
    if args.profile_batch is not None:
        table = profile_call(runtime, args.profile_batch, args.chunk_frames, generator)
        (out / "code2wav_profile.txt").write_text(table + "\n")
        print(table, f"\nwrote {out / 'code2wav_profile.txt'}", sep="\n")


if __name__ == "__main__":
    main()
