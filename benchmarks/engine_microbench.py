"""Engine microbenchmark: per-step time of each stage next to its floor, measured in the same run, for each
variant of the fast path side by side (before/after in one command).

    python benchmarks/engine_microbench.py --device cuda --stages thinker,talker --out-dir benchmarks/results/NAME
    python benchmarks/engine_microbench.py --config tiny --stages thinker,talker     # CPU smoke run

Variants (``--variants``, default ``fused,graphs``): ``eager`` = the plain torch path on the GPU (slow at full
size: ~170 ms a thinker step); ``landed`` = the fast path of per-layer Triton kernels + CUDA graphs with the
whole-step fusions off (``set_fused_steps``: the fast path as of 96702f3); ``fused`` = the fusions on, steps with
prefill rows eager (the fast path as of 8638fd2); ``graphs`` = the fusions and prefill CUDA graphs on (the fast
path as of 3f0a43b); ``splitk`` / ``gemv`` = ``graphs`` with the code predictor's linears launched split-K /
as multiply-add GEMVs for few rows (``set_linear_launch``, ``kernels.small_linear``); ``gemv`` also runs the
decoder layers' decode-step linears as GEMVs (``fast_kernels.step_linear``: qkv, o_proj, the MoE router and
shared expert), the other variants keep cuBLAS there; ``pdl`` = ``gemv`` with the kernels launched with
programmatic dependent launch (``kernels.dependent_launch``; the serving default on sm_90+, off in every other
variant). Each variant gets its own
engine (graphs captured for it) over the same model and the same random inputs.

Per batch size: thinker decode step at ~L tokens of context and thinker prefill of L-token prompts for each L
of ``--prefill-lens`` (default 108,512); talker frame (talker decode step + 15 code-predictor steps + sampling:
one engine step) and talker prefill (``--talker-prompt-len`` positions, until every row sampled its first
frame); code2wav per chunk (the first chunk of 4 frames; a later chunk of 25 frames with the exact left
context), and peak GPU memory per stage. Weights are random (``dummy`` load format) with the dimensions of
``--config`` (a shipped config, default qwen3_omni_30b_a3b, or a checkpoint dir); ``--layers`` keeps fewer
thinker/talker layers to fit smaller GPUs (the floors scale with it).

``--quantization none,fp8`` measures the thinker and the talker with bf16 weights, then with the same seeded
weights quantized to block-FP8 at load (what ``serve --quantization fp8`` serves: the thinker FP8, the talker in the
model dtype, ``models.quantization.served_in_fp8``; ``fp8-w8a8``: the linears' kernels quantize their activations
too; ``fp8-all``: the talker FP8 as well, what that policy declines), one model in memory at a time, and adds a
table of each step's ms against the first quantization's (``ratios`` in the JSON; the FP8 floors count the bytes as
stored: 1 per FP8 weight + scales):

    python benchmarks/engine_microbench.py --device cuda --stages thinker,talker --batch-sizes 1,64 \
        --prefill-lens 108 --variants pdl --quantization none,fp8 --out-dir OUT/steps

Floor of a step = max(bytes it must read / measured copy bandwidth, FLOPs / measured bf16 matmul rate):
decode reads the dense weights, the experts that the batch's tokens hit (expected fraction under uniform
routing), the lm_head and the KV cache; prefill reads every weight once; code2wav FLOPs are counted by
``torch.utils.flop_counter``. ``--profile`` prints the top kernels of a few eager fast-path steps (the talker's
with the last of ``--variants``' switches).
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from omni_triton.engine import EngineConfig, LLMEngine, SamplingParams, TalkerStage, ThinkerStage
from omni_triton.graph_buckets import capturing
from omni_triton.models.code2wav.vocoder import exact_left_context_frames
from omni_triton.models.code2wav.graphs import GraphSettings
from omni_triton.models.code2wav.runtime import Code2WavRuntime
from omni_triton.models.config import (FULL_SIZE_CONFIG, TextModelConfig, resolve_config_dir,
                                       write_config_with_layers)
from omni_triton.models.layers.fast_kernels import set_fast_kernels, set_fused_steps, set_linear_launch
from omni_triton.models.layers.fp8 import activation_dtype, set_fp8_activations
from omni_triton.models.quantization import SCALE_SUFFIX
from omni_triton.models.weights import load_talker, load_thinker
from omni_triton.pipeline.request_params import TALKER_REPETITION_PENALTY, SamplingDefaults
from omni_triton.pipeline.talker_service import TALKER_TEMPERATURE, TALKER_TOP_K

DECODE_STEPS = 16
# variant -> (fast_path, whole-step fusions, prefill CUDA graphs, the linear launch: the code predictor's and,
# under "gemv", the decode-step linears', dependent launch); see the module docstring
VARIANTS = {"eager": (False, False, False, "one-pass", False), "landed": (True, False, False, "one-pass", False),
            "fused": (True, True, False, "one-pass", False), "graphs": (True, True, True, "one-pass", False),
            "splitk": (True, True, True, "split-k", False), "gemv": (True, True, True, "gemv", False),
            "pdl": (True, True, True, "gemv", True)}
FIRST_CHUNK_FRAMES, CHUNK_FRAMES = 4, 25
# --quantization -> (the weights loaded as: load_thinker/load_talker's ``quantization``, the FP8 linears' kernel
# scheme: layers.fp8.set_fp8_activations, "bf16" = w8a16 as served, "fp8" = w8a8; the experts are w8a16 in both,
# the loaders' ``fp8_everywhere``: FP8 in the talker too, past the served policy)
QUANTIZATIONS = {"none": (None, None, False), "fp8": ("fp8", "bf16", False), "fp8-w8a8": ("fp8", "fp8", False),
                 "fp8-all": ("fp8", "bf16", True)}
QUANTIZED_STAGES = ("thinker", "talker")  # code2wav's weights stay in the model dtype


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device: torch.device, repeat: int = 5) -> float:
    """Median seconds of fn() (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeat):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def graph_seconds_per_call(issue_calls, calls: int, repeat: int = 5) -> float:
    """Median over ``repeat`` replays of a CUDA graph of ``issue_calls()`` (``calls`` launches), per call; run
    eagerly once first (compiled, scratch made) and captured with the collector kept out."""
    issue_calls()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with capturing(graph):
        issue_calls()
    graph.replay()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times)


def measure_ceilings(device: torch.device) -> tuple[float, float]:
    """(copy bandwidth in bytes/s counting read + write, bf16 matmul FLOP/s), both measured here."""
    num_bytes = 1 << 30 if device.type == "cuda" else 1 << 26
    src = torch.empty(num_bytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    bandwidth = 2 * num_bytes / min(timed(lambda: dst.copy_(src), device) for _ in range(3))
    n = 8192 if device.type == "cuda" else 512
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    matmul = 2 * n ** 3 / timed(lambda: a @ b, device)
    del src, dst, a, b
    return bandwidth, matmul


# ---------------------------------------------------------------------------------------------- floors

def expert_fraction(text: TextModelConfig, num_tokens: int) -> float:
    """Expected fraction of experts hit by num_tokens uniformly routed tokens."""
    if not text.num_experts:
        return 1.0
    return 1 - (1 - text.num_experts_per_tok / text.num_experts) ** num_tokens


def decoder_bytes(model: torch.nn.Module, skip: tuple[str, ...], text: TextModelConfig, num_tokens: int) -> float:
    """Weights a forward of num_tokens tokens reads (experts by the expected hit fraction; embedding tables
    only their rows, counted as activations)."""
    total = 0.0
    fraction = expert_fraction(text, num_tokens)
    for name, p in model.named_parameters():
        if name.startswith(skip) or "embed" in name or "codec_embedding" in name:
            continue
        total += p.numel() * p.element_size() * (fraction if ".experts." in name else 1.0)
    return total + num_tokens * text.hidden_size * activation_dtype(model).itemsize


def kv_bytes(text: TextModelConfig, context_tokens: int, element: int) -> float:
    return 2 * text.num_layers * text.num_kv_heads * text.head_dim * context_tokens * element


def active_flops(model: torch.nn.Module, skip: tuple[str, ...], text: TextModelConfig, num_tokens: int,
                 context: int) -> float:
    """Matmul FLOPs of num_tokens tokens: 2 per active weight (top-k experts) + attention over context."""
    dense = experts = 0
    for name, p in model.named_parameters():
        if name.startswith(skip) or "embed" in name or p.dim() < 2 or name.endswith(SCALE_SUFFIX):
            continue
        if ".experts." in name:
            experts += p.numel()
        else:
            dense += p.numel()
    per_token = dense + (experts * text.num_experts_per_tok / text.num_experts if text.num_experts else 0)
    attention = 4 * text.num_layers * text.num_heads * text.head_dim * context
    return num_tokens * (2 * per_token + attention)


def floor_s(num_bytes: float, flops: float, ceilings: tuple[float, float]) -> float:
    return max(num_bytes / ceilings[0], flops / ceilings[1])


TALKER_SKIP = ("code_predictor.", "text_projection.", "hidden_projection.")


def predictor_cost(talker, batch: int) -> tuple[float, float]:
    """(bytes, FLOPs) of one frame's code predictor: one forward of its layers per residual codebook, each
    lm_head once (bytes as stored: FP8 weights 1 each plus their block scales)."""
    predictor = talker.code_predictor
    matrices = [(n, p) for n, p in predictor.model.named_parameters() if p.dim() > 1 and "embed" not in n]
    layer_bytes = sum(p.numel() * p.element_size() for _, p in matrices)
    layers = sum(p.numel() for n, p in matrices if not n.endswith(SCALE_SUFFIX))
    heads = sum(h.weight.numel() for h in predictor.lm_head)
    head_bytes = sum(h.weight.numel() * h.weight.element_size() for h in predictor.lm_head)
    steps = talker.num_code_groups - 1
    return steps * layer_bytes + head_bytes, 2 * batch * (steps * layers + heads / steps)


def talker_frame_floor(talker, batch: int, context: int, ceilings) -> tuple[float, float]:
    """(seconds, bytes) of one frame: the talker step + one code-predictor forward per residual codebook."""
    text = talker.config.text
    element = activation_dtype(talker).itemsize
    predictor_bytes, predictor_flops = predictor_cost(talker, batch)
    num_bytes = decoder_bytes(talker, TALKER_SKIP, text, batch) + kv_bytes(text, batch * context, element)
    num_bytes += predictor_bytes
    flops = active_flops(talker, TALKER_SKIP, text, batch, context) + predictor_flops
    return floor_s(num_bytes, flops, ceilings), num_bytes


def talker_prefill_floor(talker, batch: int, prompt_len: int, step_tokens: int, ceilings) -> float:
    """Seconds of the talker's prefill steps over ``batch`` prompts plus the first frame's code predictor."""
    text = talker.config.text
    steps = -(-batch * prompt_len // step_tokens)
    predictor_bytes, predictor_flops = predictor_cost(talker, batch)
    return steps * floor_s(decoder_bytes(talker, TALKER_SKIP, text, step_tokens),
                           active_flops(talker, TALKER_SKIP, text, step_tokens, prompt_len // 2),
                           ceilings) + floor_s(predictor_bytes, predictor_flops, ceilings)


# ---------------------------------------------------------------------------------------------- stages

def sampling_params(sampling: str, stage: str, max_new_tokens: int) -> SamplingParams:
    """``greedy``: every row greedy (the talker's code predictor too); ``served``: what a served request samples
    with by default (the thinker: Qwen's recommended temperature/top-p/top-k; the talker: temperature 0.9,
    top-k 50, repetition penalty 1.05, its code predictor top-k 50, top-p 0.8), never stopping early."""
    if sampling == "greedy":
        return SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True)
    if stage == "thinker":
        defaults = SamplingDefaults()
        return SamplingParams(temperature=defaults.temperature, top_p=defaults.top_p, top_k=defaults.top_k,
                              max_new_tokens=max_new_tokens, ignore_eos=True, seed=0)
    return SamplingParams(temperature=TALKER_TEMPERATURE, top_k=TALKER_TOP_K,
                          repetition_penalty=TALKER_REPETITION_PENALTY, max_new_tokens=max_new_tokens,
                          ignore_eos=True, seed=0)


def apply_variant(model: torch.nn.Module, variant: str) -> None:
    """The model's switches as ``variant`` wants them. They live on the shared model, so they are set again
    before every run of a variant's engine (its graphs were captured with them; its eager steps read them)."""
    fast_path, fused_steps, _, linear_launch, dependent_launch = VARIANTS[variant]
    set_fast_kernels(model, fast_path)
    set_fused_steps(model, fused_steps)
    set_linear_launch(model, linear_launch)
    if torch.cuda.is_available():  # process-wide, read at each launch (kernels import triton: CUDA runs only)
        from omni_triton.kernels.dependent_launch import set_dependent_launch

        set_dependent_launch(dependent_launch)


def make_engine(stage, model, args, max_batch: int, context: int, variant: str, cuda_graphs: bool = True
                ) -> LLMEngine:
    """An engine for ``variant``, its switches set before it captures its graphs."""
    fast_path, _, prefill_graphs, linear_launch, dependent_launch = VARIANTS[variant]
    apply_variant(model, variant)
    dtype = activation_dtype(model)
    blocks = max_batch * (-(-context // 16) + 1) + 16
    return LLMEngine(stage, EngineConfig(
        block_size=16, num_blocks=blocks, max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=max_batch,
        device=args.device, kv_dtype=dtype, fast_path=fast_path, cuda_graphs=cuda_graphs,
        prefill_graph_tokens=None if prefill_graphs else 0, linear_launch=linear_launch,
        dependent_launch=dependent_launch, overlap_steps=getattr(args, "overlap_steps", EngineConfig.overlap_steps)))


def launch_counts(model, make, case, variants: list[str], device: torch.device) -> dict[str, dict[str, int]]:
    """{variant: {"prefill_step": kernels, "decode_step": kernels}}: GPU kernels launched by the first (prefill)
    step and by one decode step of ``case``, on an engine without CUDA graphs (so each launch shows; under a
    graph they are the same kernels, replayed). CUDA only: {} elsewhere."""
    from torch.profiler import ProfilerActivity, profile

    if device.type != "cuda":
        return {}
    counts = {}
    for variant in variants:
        engine, adder = make(variant, cuda_graphs=False)
        adder(case)()
        counts[variant] = {}
        for name in ("prefill_step", "decode_step", "decode_step"):  # the first decode step compiles: count the second
            sync(device)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                engine.step()
                sync(device)
            counts[variant][name] = sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
        while engine.has_work():
            engine.step()
        del engine
    return counts


def variant_runs(model, make, cases: list, warmups: list, variants: list[str], device: torch.device) -> dict[str, dict]:
    """{variant: {case: (prefill s, decode step s, peak GiB)}}: one engine per variant (``make(variant)`` ->
    (engine, adder); ``adder(case)()`` adds a case's requests), each warmed up on ``warmups`` so every step
    shape is compiled, then the variants measured in turn on each case (interleaved, so drift in clocks or
    load hits all alike)."""
    engines = {}
    for variant in variants:
        engines[variant] = make(variant)
        for case in warmups:
            run_batch(*engines[variant], case, device)
    runs: dict[str, dict] = {variant: {} for variant in variants}
    for case in cases:
        for variant, engine_adder in engines.items():
            apply_variant(model, variant)
            torch.cuda.reset_peak_memory_stats() if device.type == "cuda" else None
            prefill_s, step_s = run_batch(*engine_adder, case, device)
            runs[variant][case] = (prefill_s, step_s, peak_gib(device))
    del engines
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return runs


def run_batch(engine: LLMEngine, adder, case, device: torch.device) -> tuple[float, float]:
    """(prefill seconds until every request of ``adder(case)`` sampled its first token, median decode step
    seconds)."""
    adder(case)()
    sync(device)
    start = time.perf_counter()
    while any(seq.num_generated == 0 for seq in engine.requests.values()):
        engine.step()
    sync(device)
    prefill_s = time.perf_counter() - start
    steps = []
    while engine.has_work():  # each step reads its sampled ids back: wall time per step is honest
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    return prefill_s, statistics.median(steps[1:] or steps)


def load_weights(load, args, quantization: str, **kwargs) -> torch.nn.Module:
    """``load`` (load_thinker / load_talker) of the random weights, FP8 where ``quantization`` says
    (``QUANTIZATIONS``): the same seeded values either way, FP8 rounded at load as ``serve --quantization fp8``."""
    weights, activations, everywhere = QUANTIZATIONS[quantization]
    model = load(args.config_dir, torch.device(args.device), args.dtype, load_format="dummy", quantization=weights,
                 fp8_everywhere=everywhere, **kwargs)
    if activations is not None:
        set_fp8_activations(model, activations)
    return model


def bench_thinker(args, ceilings, batches: list[int], quantization: str = "none") -> dict:
    device = torch.device(args.device)
    model = load_weights(load_thinker, args, quantization, with_audio=False)
    text = model.config.text
    params = sampling_params(args.sampling, "thinker", DECODE_STEPS + 1)
    element = activation_dtype(model).itemsize
    longest = max(args.prefill_lens)

    def make(variant, cuda_graphs=True):
        engine = make_engine(ThinkerStage(model), model, args, max(batches), longest + DECODE_STEPS + 2, variant,
                             cuda_graphs)
        generator = torch.Generator().manual_seed(0)

        def adder(case):
            prompt_len, batch = case

            def add():
                for i in range(batch):
                    prompt = torch.randint(0, text.vocab_size, (prompt_len,), generator=generator).tolist()
                    engine.add_request(f"b{batch}-{i}", params, prompt_token_ids=prompt)
            return add
        return engine, adder

    cases = [(n, batch) for n in args.prefill_lens for batch in batches]
    warmups = [(n, batch) for n in args.prefill_lens for batch in (1, max(batches))]
    runs = variant_runs(model, make, cases, warmups, args.variants, device)
    launches = launch_counts(model, make, (args.prefill_lens[0], 1), args.variants, device)
    rows = []
    for prompt_len, batch in cases:
        context = prompt_len + DECODE_STEPS // 2
        decode_bytes = decoder_bytes(model, (), text, batch) + kv_bytes(text, batch * context, element)
        decode_floor = floor_s(decode_bytes, active_flops(model, (), text, batch, context), ceilings)
        tokens = batch * prompt_len
        step_tokens = min(tokens, args.max_num_batched_tokens)
        prefill_floor = -(-tokens // step_tokens) * floor_s(
            decoder_bytes(model, (), text, step_tokens), active_flops(model, (), text, step_tokens, prompt_len // 2),
            ceilings)
        row = dict(prompt_len=prompt_len, batch=batch, decode_floor_ms=1e3 * decode_floor,
                   prefill_floor_ms=1e3 * prefill_floor, variants={})
        for variant, by_case in runs.items():
            prefill_s, step_s, peak = by_case[prompt_len, batch]
            row["variants"][variant] = dict(
                decode_ms=1e3 * step_s, decode_ratio=step_s / decode_floor,
                decode_gb_s=decode_bytes / step_s / 1e9, prefill_ms=1e3 * prefill_s,
                prefill_ratio=prefill_s / prefill_floor, peak_gib=peak)
        rows.append(row)
    apply_variant(model, "fused")
    if args.profile:
        profile_steps(model, ThinkerStage(model), args, [1, max(batches)], args.prefill_lens[-1])
    del model
    return dict(rows=rows, layers=text.num_layers, launches=launches, launches_prompt_len=args.prefill_lens[0])


def talker_stage(model, args) -> TalkerStage:
    zeros = torch.zeros(model.hidden_size, dtype=args.dtype, device=args.device)
    return TalkerStage(model, tts_eos_embed=zeros, tts_pad_embed=zeros)


def bench_talker(args, ceilings, batches: list[int], quantization: str = "none") -> dict:
    device = torch.device(args.device)
    model = load_weights(load_talker, args, quantization)
    text = model.config.text
    prompt_len = args.talker_prompt_len
    params = sampling_params(args.sampling, "talker", DECODE_STEPS + 1)

    def make(variant, cuda_graphs=True):
        engine = make_engine(talker_stage(model, args), model, args, max(batches), prompt_len + DECODE_STEPS + 2,
                             variant, cuda_graphs)
        generator = torch.Generator().manual_seed(1)

        def adder(batch):
            def add():
                for i in range(batch):
                    prompt = torch.randn(prompt_len, model.hidden_size, generator=generator).to(args.device, args.dtype)
                    engine.add_request(f"b{batch}-{i}", params, prompt_embeds=prompt, thinker_finished=True)
            return add
        return engine, adder

    runs = variant_runs(model, make, batches, [1, max(batches)], args.variants, device)
    launches = launch_counts(model, make, 1, args.variants, device)
    rows = []
    for batch in batches:
        floor, num_bytes = talker_frame_floor(model, batch, prompt_len + DECODE_STEPS // 2, ceilings)
        prefill_floor = talker_prefill_floor(model, batch, prompt_len,
                                             min(batch * prompt_len, args.max_num_batched_tokens), ceilings)
        row = dict(batch=batch, frame_floor_ms=1e3 * floor, prefill_floor_ms=1e3 * prefill_floor, variants={})
        for variant, by_batch in runs.items():
            prefill_s, step_s, peak = by_batch[batch]
            row["variants"][variant] = dict(frame_ms=1e3 * step_s, frame_ratio=step_s / floor,
                                            frame_gb_s=num_bytes / step_s / 1e9, prefill_ms=1e3 * prefill_s,
                                            prefill_ratio=prefill_s / prefill_floor, peak_gib=peak)
        rows.append(row)
    apply_variant(model, args.variants[-1])  # what --profile's steps run (their engine: the fast path on)
    if args.profile:
        profile_steps(model, talker_stage(model, args), args, [1, max(batches)], prompt_len)
    layers = text.num_layers
    del model
    return dict(rows=rows, prompt_len=prompt_len, layers=layers, launches=launches)


def bench_code2wav(args, ceilings, batches: list[int], quantization: str = "none") -> dict:
    """Eager: the model's forward. Graph: the code2wav stage's own path, the torch runtime's ``decode`` with
    ``cuda_graphs`` (first-chunk graphs captured when it is built, batch buckets up to the largest batch here).
    Never quantized (``QUANTIZED_STAGES``): run once, under the first ``--quantization``."""
    device = torch.device(args.device)
    runtime = Code2WavRuntime.create(
        "torch", args.config_dir, device=device, dtype=args.dtype, load_format="dummy",
        cuda_graphs=device.type == "cuda",
        graph_settings=GraphSettings.for_stage(max_batch=max(batches), first_chunk_frames=FIRST_CHUNK_FRAMES))
    model = runtime.model
    config = model.config
    context = exact_left_context_frames(config)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    rows = []
    generator = torch.Generator().manual_seed(2)
    with torch.inference_mode():
        for batch in batches:
            row = dict(batch=batch)
            for name, frames in (("first", FIRST_CHUNK_FRAMES), ("later", context + CHUNK_FRAMES)):
                codes = torch.randint(0, config.codebook_size, (batch, config.num_quantizers, frames),
                                      generator=generator).to(device)
                torch.cuda.reset_peak_memory_stats() if device.type == "cuda" else None
                try:
                    seconds = timed(lambda: model(codes), device)
                except torch.OutOfMemoryError:
                    row[f"{name}_ms"] = None
                    continue
                with FlopCounterMode(display=False) as counter:
                    model(codes)
                floor = floor_s(weight_bytes, counter.get_total_flops(), ceilings)
                row.update({f"{name}_ms": 1e3 * seconds, f"{name}_floor_ms": 1e3 * floor,
                            f"{name}_ratio": seconds / floor, f"{name}_peak_gib": peak_gib(device)})
                if name == "first" and runtime.graphs is not None:
                    row["first_graph_ms"] = 1e3 * runtime_graph_seconds(runtime, codes)
            rows.append(row)
    del model, runtime
    return dict(rows=rows, left_context_frames=context)


def runtime_graph_seconds(runtime: Code2WavRuntime, codes: torch.Tensor) -> float:
    """The runtime's ``decode`` of ``codes`` (input copy, graph replay, rows copied out), as the stage calls it."""
    replays = runtime.graphs.replays
    seconds = timed(lambda: runtime.decode(codes), codes.device, repeat=20)
    if runtime.graphs.replays == replays:
        raise RuntimeError(f"codes {tuple(codes.shape)} did not replay a graph: the timing would be eager")
    return seconds


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated() / 2 ** 30 if device.type == "cuda" else None


def profile_steps(model, stage, args, batches: list[int], prompt_len: int) -> None:
    """Top kernels by GPU time of the first (prefill) step and of a few decode steps, eager with the fast path's
    kernels (CUDA graphs off, so each launch shows), and the experts the real routing hits per MoE layer."""
    from torch.profiler import ProfilerActivity, profile

    device = torch.device(args.device)
    text = model.config.text
    moe_inputs: list[tuple[torch.nn.Module, torch.Tensor]] = []  # per MoE layer call, routed after the steps

    def keep_moe_input(block, inputs, _output):
        # only a reference here: routing it (the router's product, a top-k, a sort and a host sync per layer)
        # would show in the profile as if the step ran it; the block's input rather than the router's output,
        # since the fast path runs the router inside a packed projection
        moe_inputs.append((block, inputs[0]))

    hooks = [module.register_forward_hook(keep_moe_input) for module in model.modules() if hasattr(module, "experts")]
    activity, sort_by = ((ProfilerActivity.CUDA, "cuda_time_total") if device.type == "cuda"
                         else (ProfilerActivity.CPU, "cpu_time_total"))
    generator = torch.Generator().manual_seed(3)
    for batch in batches:
        engine = LLMEngine(stage, EngineConfig(block_size=16, num_blocks=batch * (prompt_len // 16 + 4) + 16,
                                               max_num_batched_tokens=args.max_num_batched_tokens,
                                               max_num_seqs=batch, device=args.device, kv_dtype=args.dtype,
                                               fast_path=True, cuda_graphs=False,
                                               linear_launch=VARIANTS[args.variants[-1]][3],
                                               dependent_launch=VARIANTS[args.variants[-1]][4]))
        params = sampling_params(args.sampling, "thinker" if isinstance(stage, ThinkerStage) else "talker", 8)
        for i in range(batch):
            if isinstance(stage, ThinkerStage):
                prompt = torch.randint(0, text.vocab_size, (prompt_len,), generator=generator).tolist()
                engine.add_request(str(i), params, prompt_token_ids=prompt)
            else:
                prompt = torch.randn(prompt_len, model.hidden_size, generator=generator).to(args.device, args.dtype)
                engine.add_request(str(i), params, prompt_embeds=prompt, thinker_finished=True)
        for phase, steps in (("first (prefill) step", 1), ("3 decode steps", 3)):
            while phase != "first (prefill) step" and any(seq.num_generated < 3 for seq in engine.requests.values()):
                engine.step()
            sync(device)
            moe_inputs.clear()
            started = time.perf_counter()
            with profile(activities=[activity]) as prof:
                for _ in range(steps):
                    engine.step()
                sync(device)
            wall_ms = 1e3 * (time.perf_counter() - started)
            kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            with torch.inference_mode():  # (tokens, distinct experts) per MoE layer call
                hits = [(x.shape[0], block.gate(x).topk(text.num_experts_per_tok).indices.unique().numel())
                        for block, x in moe_inputs]
            tokens = sum(t for t, _ in hits) / max(1, len(hits))
            experts = sum(e for _, e in hits) / max(1, len(hits))
            print(f"\n--- {type(stage).__name__} batch {batch}, {phase}: {tokens:.0f} tokens per MoE call hit "
                  f"{experts:.1f} of {text.num_experts} experts (uniform routing: "
                  f"{text.num_experts * expert_fraction(text, round(tokens)):.1f}); top kernels ---")
            if kernels:  # GPU busy time against wall time: how far the step is from host-bound
                busy_ms = sum(e.time_range.elapsed_us() for e in kernels) / 1e3
                print(f"{len(kernels)} kernels, {busy_ms:.2f} ms summed on the GPU, {wall_ms:.2f} ms wall "
                      f"(profiler on) for {steps} step(s)")
            print(prof.key_averages().table(sort_by=sort_by, row_limit=25, max_name_column_width=60))
        del engine
    for hook in hooks:
        hook.remove()


# ---------------------------------------------------------------------------------------------- report

def variant_cells(row: dict, variants: list[str], key: str) -> str:
    """'ms (ratio x)' of ``key`` per variant, as table cells."""
    cells = []
    for variant in variants:
        v = row["variants"][variant]
        cells.append(f"{v[key + '_ms']:.2f} ({v[key + '_ratio']:.2f}x)")
    return " | ".join(cells)


def launch_lines(launches: dict | None, what: str) -> list[str]:
    """'Kernel launches ...' line of a stage (none on CPU)."""
    if not launches:
        return []
    per_variant = "; ".join(f"{variant} {c['prefill_step']} / {c['decode_step']}" for variant, c in launches.items())
    return [f"GPU kernels launched at batch 1 by {what} (eager, no CUDA graphs): {per_variant}.", ""]


def markdown(result: dict) -> str:
    variants = result["variants"]
    labels = result.get("quantization", ["none"])
    lines = [f"Device: {result['device_name']}; {result['config']} (random {result['dtype']} weights, dummy "
             f"load); copy {result['copy_gb_s']:.0f} GB/s, bf16 matmul {result['matmul_tflops']:.0f} TFLOP/s "
             f"(measured in this run). Variants (ms, ratio to the floor): {', '.join(variants)}. Rows sample: "
             f"{result.get('sampling', 'greedy')} (--sampling).", "",
             f"Command: `{result['command']}`", ""]
    if len(labels) > 1:
        lines += [f"### Weights: {labels[0]}", ""]
    lines += stage_tables(result, variants)
    for label, stages in result.get("quantized", {}).items():
        lines += [f"### Weights: {label} ({QUANTIZATION_NOTES[label]})", ""] + stage_tables(stages, variants)
    if result.get("ratios"):
        lines += ratio_table(result["ratios"], labels)
    return "\n".join(lines) + "\n"


def stage_tables(result: dict, variants: list[str]) -> list[str]:
    """The tables of each stage in ``result`` (thinker, talker, code2wav)."""
    names = " | ".join(variants)
    lines = []
    bars = "|---:" * (2 + len(variants)) + "|"
    if "thinker" in result:
        t = result["thinker"]
        for prompt_len in sorted({r["prompt_len"] for r in t["rows"]}):
            rows = [r for r in t["rows"] if r["prompt_len"] == prompt_len]
            lines += [f"Thinker ({t['layers']} layers), decode step at ~{prompt_len} tokens of context:", "",
                      f"| batch | floor ms | {names} |", bars]
            lines += [f"| {r['batch']} | {r['decode_floor_ms']:.2f} | {variant_cells(r, variants, 'decode')} |"
                      for r in rows]
            lines += ["", f"Thinker prefill of {prompt_len}-token prompts (until every row sampled):", "",
                      f"| batch | floor ms | {names} |", bars]
            lines += [f"| {r['batch']} | {r['prefill_floor_ms']:.2f} | {variant_cells(r, variants, 'prefill')} |"
                      for r in rows]
            lines.append("")
        lines += launch_lines(t.get("launches"), f"the prefill step of one {t.get('launches_prompt_len')}-token "
                              "prompt / one decode step")
    if "talker" in result:
        t = result["talker"]
        lines += [f"Talker frame ({t['layers']} layers; talker step + 15 code-predictor steps + sampling, one "
                  "engine step):", "", f"| batch | floor ms | {names} |", bars]
        lines += [f"| {r['batch']} | {r['frame_floor_ms']:.3f} | {variant_cells(r, variants, 'frame')} |"
                  for r in t["rows"]]
        lines += ["", f"Talker prefill of {t['prompt_len']} positions (until every row has its first frame):", "",
                  f"| batch | floor ms | {names} |", bars]
        lines += [f"| {r['batch']} | {r['prefill_floor_ms']:.2f} | {variant_cells(r, variants, 'prefill')} |"
                  for r in t["rows"]]
        lines.append("")
        lines += launch_lines(t.get("launches"), f"the prefill step of one {t['prompt_len']}-position prompt "
                              "(with its first frame) / one frame")
    if "code2wav" in result:
        c = result["code2wav"]
        lines += [f"Code2Wav per chunk: first = {FIRST_CHUNK_FRAMES} frames; later = {CHUNK_FRAMES} frames + "
                  f"{c['left_context_frames']} frames of exact left context (eager; 'graph' = the first chunk "
                  "through the code2wav runtime's CUDA-graph path, as the served stage runs it with --cuda-graphs on):",
                  "",
                  "| batch | first ms | graph ms | floor ms | ratio | later ms | floor ms | ratio | peak GiB |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['batch']} | {_num(r.get('first_ms'))} | {_num(r.get('first_graph_ms'))} | "
                  f"{_num(r.get('first_floor_ms'), 3)} | {_num(r.get('first_ratio'))} | {_num(r.get('later_ms'))} | "
                  f"{_num(r.get('later_floor_ms'))} | {_num(r.get('later_ratio'))} | {_num(r.get('later_peak_gib'))} |"
                  for r in c["rows"]]
        lines.append("")
    return lines


QUANTIZATION_NOTES = {"fp8": "block-FP8 thinker linears and experts, w8a16 kernels, the talker in the model dtype: "
                             "as served",
                      "fp8-w8a8": "block-FP8 thinker, the linears' kernels w8a8 (activations quantized per row and 128 "
                                  "columns), the experts w8a16, the talker in the model dtype",
                      "fp8-all": "block-FP8 thinker and talker linears and experts, w8a16 kernels (the talker FP8 "
                                 "too: what the served policy declines)"}
RATIO_STEPS = {"thinker": ("decode", "prefill"), "talker": ("frame", "prefill")}


def quantization_ratios(base: dict, other: dict, label: str) -> list[dict]:
    """Every step both runs measured (stage, step, context, batch, variant): the base run's ms, ``label``'s
    and their ratio (``label`` / base: < 1 is faster)."""
    ratios = []
    for stage, steps in RATIO_STEPS.items():
        if stage not in base or stage not in other:
            continue
        theirs = {(r.get("prompt_len"), r["batch"]): r for r in other[stage]["rows"]}
        for step in steps:
            for row in base[stage]["rows"]:
                match = theirs.get((row.get("prompt_len"), row["batch"]))
                for variant, cells in row["variants"].items():
                    if match is None or variant not in match["variants"]:
                        continue
                    base_ms, ms = cells[f"{step}_ms"], match["variants"][variant][f"{step}_ms"]
                    ratios.append(dict(stage=stage, step=step, prompt_len=row.get("prompt_len"), batch=row["batch"],
                                       variant=variant, quantization=label, base_ms=base_ms, ms=ms,
                                       ratio=ms / base_ms))
    return ratios


def ratio_table(ratios: list[dict], labels: list[str]) -> list[str]:
    """One row per step, case and variant: the base run's ms, then each other run's ms (ratio to the base)."""
    cases: dict[tuple, dict] = {}
    for r in ratios:
        case = cases.setdefault((r["stage"], r["step"], r["prompt_len"], r["batch"], r["variant"]),
                                {"base_ms": r["base_ms"]})
        case[r["quantization"]] = f"{r['ms']:.2f} ({r['ratio']:.2f}x)"
    others = labels[1:]
    lines = [f"Against {labels[0]} (ms; ratio = quantized / {labels[0]}, < 1: faster):", "",
             f"| step | batch | variant | {labels[0]} ms | " + " | ".join(f"{label} ms (ratio)" for label in others)
             + " |", "|---|---:|---|---:|" + "---:|" * len(others)]
    for (stage, step, prompt_len, batch, variant), cells in cases.items():
        what = f"{stage} {step}" + (f" (~{prompt_len} tokens)" if prompt_len is not None else "")
        lines.append(f"| {what} | {batch} | {variant} | {cells['base_ms']:.2f} | "
                     + " | ".join(cells.get(label, "-") for label in others) + " |")
    return lines + [""]


def _num(value, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=FULL_SIZE_CONFIG, help="shipped config name, 'tiny', or checkpoint dir")
    parser.add_argument("--stages", default="thinker,talker,code2wav")
    parser.add_argument("--layers", type=int, default=0, help="keep this many thinker/talker layers (0 = all)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--quantization", default="none",
                        help=f"comma list of {', '.join(QUANTIZATIONS)}: the thinker and talker measured with each "
                             "in turn (one model in memory at a time), every later one against the first")
    parser.add_argument("--batch-sizes", default="1,8,32,64")
    parser.add_argument("--prefill-lens", default="108,512", help="thinker prompt lengths (decode context too)")
    parser.add_argument("--talker-prompt-len", type=int, default=128)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--variants", default="fused,graphs", help=f"comma list of {', '.join(VARIANTS)}")
    parser.add_argument("--sampling", default="greedy", choices=["greedy", "served"],
                        help="greedy rows, or the served defaults' sampling (see sampling_params)")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads for torch")
    parser.add_argument("--out-dir", default=".")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.dtype = getattr(torch, args.dtype)
    args.config_dir = config_dir(args.config, args.layers)
    device = torch.device(args.device)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    args.prefill_lens = [int(n) for n in args.prefill_lens.split(",")]
    args.variants = args.variants.split(",")
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    labels = args.quantization.split(",")
    unknown = sorted(set(labels) - set(QUANTIZATIONS))
    if unknown or len(set(labels)) != len(labels):
        parser.error(f"--quantization: {args.quantization!r}: each of {', '.join(QUANTIZATIONS)} at most once")

    bandwidth, matmul = measure_ceilings(device)
    result = dict(device_name=torch.cuda.get_device_name() if device.type == "cuda" else platform.processor(),
                  config=args.config + (f" ({args.layers} layers)" if args.layers else ""), variants=args.variants,
                  dtype=str(args.dtype).removeprefix("torch."), quantization=labels,
                  sampling=args.sampling, copy_gb_s=bandwidth / 1e9, matmul_tflops=matmul / 1e12,
                  torch=torch.__version__,
                  command="python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]))
    benches = {"thinker": bench_thinker, "talker": bench_talker, "code2wav": bench_code2wav}
    stages = args.stages.split(",")
    if set(stages) - set(benches):
        parser.error(f"--stages: unknown {sorted(set(stages) - set(benches))}; choose from {', '.join(benches)}")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # in the order given, each quantization of a stage in turn; the files are rewritten after each part, so a
    # cut-off run keeps what it measured. The first quantization's parts sit at result[stage], the others' at
    # result["quantized"][label][stage]
    for stage in stages:
        for label in labels if stage in QUANTIZED_STAGES else labels[:1]:
            started = time.perf_counter()
            part = benches[stage](args, (bandwidth, matmul), batches, label)
            part["seconds"] = time.perf_counter() - started  # what the part took, loading and capture included
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            home = result if label == labels[0] else result.setdefault("quantized", {}).setdefault(label, {})
            home[stage] = part
            result["ratios"] = [ratio for other, stages_of in result.get("quantized", {}).items()
                                for ratio in quantization_ratios(result, stages_of, other)]
            print(f"--- {stage}, weights {label}: {part['seconds']:.0f} s ---")
            print("\n".join(stage_tables({stage: part}, args.variants)), flush=True)
            (out / "engine_microbench.json").write_text(json.dumps(result, indent=2) + "\n")
            (out / "engine_microbench.md").write_text(markdown(result))
    if result.get("ratios"):
        print("\n".join(ratio_table(result["ratios"], labels)))
    print(f"wrote {out / 'engine_microbench.json'} and {out / 'engine_microbench.md'}")


def config_dir(config: str, layers: int) -> Path:
    """The config dir to build from: a shipped config or checkpoint dir, the tiny preset (written on the fly),
    with thinker/talker layers cut to ``layers`` when asked (a copy in a temp dir)."""
    if config == "tiny":
        from omni_triton.checkpoints.tiny import build

        source = build(Path(tempfile.gettempdir()) / "engine_microbench_tiny", "tiny")
    else:
        source = resolve_config_dir(config)
    if not layers:
        return source
    return write_config_with_layers(source, layers, tempfile.mkdtemp(prefix="engine_microbench_"))


if __name__ == "__main__":
    main()
