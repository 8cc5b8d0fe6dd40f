"""Launch options that ``omni-triton serve`` and ``omni-triton bench`` share: which weights (a checkpoint dir,
or seeded random weights of a model config with no checkpoint on disk: ``--config NAME --load-format dummy``),
the KV budget, and the engines' fast path.

``--config`` takes a shipped config name (``qwen3_omni_30b_a3b``: Qwen3-Omni-30B-A3B's dimensions) or a dir
with config.json; the stages then read a dummy checkpoint dir built from it once
(``omni_triton.checkpoints.dummy``: the config, a tokenizer with the config's token ids, a generation
config; ``checkpoints/dummy/<name>``), and build their weights on the device.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

from omni_triton.launch.memory_plan import (DEFAULT_UTILIZATION, THINKER_KV_SHARE, kv_budget, kv_tokens_setting,
                                            word_or_count)
from omni_triton.shared.placement import (GPU_STAGES, REPLICABLE_STAGES, Placement, PlacementError, parse_instances,
                                          parse_stage_gpus)
from omni_triton.shared.settings import (CHUNK_PACING, CPU_KV_CACHE_TOKENS, LINEAR_LAUNCHES, LOAD_FORMATS,
                                         QUANTIZATIONS, LaunchConfig, admission_capacity_setting, hold_ms_setting,
                                         on_off, seconds_setting)


class LaunchOptionError(ValueError):
    """Launch options that do not go together; the message names them."""


@dataclass(frozen=True)
class ModelSource:
    checkpoint_dir: Path
    load_format: str = "safetensors"
    seed: int = 0

    @property
    def random_weights(self) -> bool:
        return self.load_format == "dummy"


def add_model_source_arguments(group) -> None:
    """--config, --load-format, --dummy-seed, --dummy-layers, --quantization (the caller adds its own
    --checkpoint)."""
    group.add_argument("--config", metavar="NAME_OR_DIR",
                       help="serve seeded random weights of this model config, no checkpoint needed: a shipped "
                            "config (qwen3_omni_30b_a3b = Qwen3-Omni-30B-A3B's dimensions) or a dir with "
                            "config.json; implies --load-format dummy (default: none, serve --checkpoint)")
    group.add_argument("--load-format", choices=LOAD_FORMATS,
                       help="safetensors: the checkpoint's weights; dummy: seeded random weights built on the "
                            "device from config.json (default: safetensors, dummy with --config)")
    group.add_argument("--dummy-seed", type=int, default=LaunchConfig.dummy_seed,
                       help="seed of the dummy weights (default: %(default)s)")
    group.add_argument("--dummy-layers", type=int, metavar="N",
                       help="with --config: cut thinker and talker to at most N layers (full width), e.g. to fit "
                            "a smaller GPU (default: the config's)")
    group.add_argument("--quantization", choices=QUANTIZATIONS, default=LaunchConfig.quantization,
                       help="fp8: the thinker's decoder linears and experts quantized at load to block-FP8 (128 x "
                            "128 blocks, docs/fp8.md), the checkpoint's or the random weights; the talker stays in "
                            "the model dtype; a checkpoint with an FP8 quantization_config is served so either way "
                            "(default: %(default)s)")


def add_memory_arguments(group) -> None:
    """What sizes GPU memory beyond the weights: the KV budget, and the vocoder's activations (frames and chunks
    per call)."""
    thinker, talker = round(100 * THINKER_KV_SHARE), 100 - round(100 * THINKER_KV_SHARE)
    group.add_argument("--kv-cache-tokens", type=kv_tokens_setting, default="auto",
                       help="KV budget per engine in tokens, or auto: on cuda what fits the GPU memory free at "
                            f"launch after weights and activations ({thinker}%% of the KV bytes to the thinker, "
                            f"{talker}%% to the talker; printed at start), on cpu {CPU_KV_CACHE_TOKENS} "
                            "(default: %(default)s)")
    group.add_argument("--gpu-memory-utilization", type=float, default=DEFAULT_UTILIZATION,
                       help="with --kv-cache-tokens auto on cuda: the fraction of the GPU memory free at launch "
                            "that weights, activations and KV caches may fill (default: %(default)s)")
    group.add_argument("--left-context-frames", type=left_context_setting,
                       help="how a code2wav chunk gets its past: stateful (new frames only, the vocoder keeps each "
                            "stream's state: one-pass audio at the cost of the new frames), exact (re-decode the "
                            "vocoder's whole receptive field per chunk), or a frame count (less compute than exact, "
                            "audio no longer equal to a one-pass decode) (default: stateful with --code2wav-runtime "
                            "torch and one code2wav instance, exact otherwise)")
    group.add_argument("--code2wav-max-batch", type=int, default=LaunchConfig.code2wav_max_batch,
                       help="audio chunks decoded together in one vocoder call; its activations grow with it "
                            "(default: %(default)s)")
    group.add_argument("--code2wav-overlap", choices=["on", "off"], default=on_off(LaunchConfig.code2wav_overlap),
                       help="cuda: a code2wav call returns to Triton once the previous call's decode is done, so "
                            "the next call's host work runs while this one decodes (two calls queued on the GPU; "
                            "a chunk may wait one decode longer) (default: %(default)s)")
    # the torch code2wav's GPU switches: each an on/off flag named after its LaunchConfig field
    for flag, why in (
            ("--code2wav-cudnn-autotune", "cuDNN times its convolution algorithms once per call shape and keeps the "
                                          "fastest (off: its heuristic's pick; each shape's first call is slower with "
                                          "it on, before its CUDA graph is captured)"),
            ("--code2wav-dilated-phases", "its dilated convolutions as undilated ones over the input's interleaved "
                                          "phases, which cuDNN's heuristic serves with its fast kernels (the same "
                                          "sums, in a shape that needs no timing)"),
            ("--code2wav-triton-snake", "each SnakeBeta activation as one fused Triton kernel (fp32 inside, rounded "
                                        "once) instead of torch's five to six elementwise launches")):
        field = flag[2:].replace("-", "_")
        group.add_argument(flag, choices=["on", "off"], default=on_off(getattr(LaunchConfig, field)),
                           help=f"torch code2wav on cuda: {why} (default: %(default)s)")

def add_engine_arguments(group) -> None:
    group.add_argument("--fast-path", choices=["on", "off"], default=on_off(LaunchConfig.fast_path),
                       help="cuda: the engines' Triton kernels and GPU sampling (off: the plain torch path, the "
                            "reference; the CPU always runs it) (default: %(default)s)")
    group.add_argument("--cuda-graphs", choices=["on", "off"], default=on_off(LaunchConfig.cuda_graphs),
                       help="cuda: with --fast-path on, the engines' decode steps as CUDA graphs; with or without "
                            "it, the code2wav torch runtime's short chunks (first-chunk shapes captured at start) "
                            "(default: %(default)s)")
    group.add_argument("--prefill-graphs", choices=["on", "off"], default=on_off(LaunchConfig.prefill_graphs),
                       help="cuda: with --fast-path and --cuda-graphs on, the engines' steps with prefill rows "
                            "(prompts, chunks, mixed steps of up to --max-batched-tokens) as CUDA graphs too, one "
                            "per token bucket, captured at start (default: %(default)s)")
    group.add_argument("--linear-launch", choices=LINEAR_LAUNCHES, default=LaunchConfig.linear_launch,
                       help="cuda: with --fast-path on, how the talker's code predictor launches its small linears: "
                            "gemv (multiply-adds for 1-2 rows, split-K up to 32, one pass above, cuBLAS for the wide "
                            "outputs from 8 rows; the decode steps' layer linears at 1-2 rows too), split-k (no GEMV, the "
                            "predictor's wide outputs fused at every row count too), or one-pass (one MMA tile a "
                            "program, never split); the two last keep cuBLAS for the layers (default: %(default)s)")
    group.add_argument("--dependent-launch", choices=["on", "off"], default=on_off(LaunchConfig.dependent_launch),
                       help="cuda sm_90+: with --fast-path on, the engines' Triton kernels start while the previous "
                            "kernel ends (programmatic dependent launch; the linears prefetch their weights "
                            "meanwhile) (default: %(default)s)")
    group.add_argument("--overlap-steps", choices=["on", "off"], default=on_off(LaunchConfig.overlap_steps),
                       help="the thinker and the talker (under its CUDA graphs) launch each decode step before the "
                            "last one's tokens reach the host, whose host work then runs while the GPU computes (the "
                            "same tokens; engine/overlap.py) (default: %(default)s)")
    group.add_argument("--prefix-caching", choices=["on", "off"], default=on_off(LaunchConfig.prefix_caching),
                       help="the thinker and the talker reuse the KV blocks (and streamed states) of prompt prefixes "
                            "computed before: a conversation's later turns and a shared system prompt cost only "
                            "their new tokens (docs/prefix_caching.md) (default: %(default)s)")
    group.add_argument("--stage-output-hold-ms", type=_hold_ms, metavar="MS", default=LaunchConfig.stage_output_hold_ms,
                       help="the thinker and the talker send each stream's outputs a few steps at a time (the talker's "
                            "first at --first-chunk-frames frames, then 8; the thinker's first 8 tokens at once, then "
                            "4), none held longer than this: fewer, larger responses for the orchestrator to handle "
                            "under load; 0: every step (docs/performance.md) (default: %(default)s)")
    group.add_argument("--thinker-tokens-per-output", type=_positive_int, metavar="N",
                       default=LaunchConfig.thinker_tokens_per_output,
                       help="the thinker's responses after its first 8 tokens carry at least N tokens (each becomes "
                            "one talker append request and one text delta), within --thinker-output-hold-ms "
                            "(default: %(default)s)")
    group.add_argument("--thinker-output-hold-ms", type=_hold_ms, metavar="MS",
                       default=LaunchConfig.thinker_output_hold_ms,
                       help="the longest the thinker holds a stream's tokens for --thinker-tokens-per-output; "
                            "0: every step (default: --stage-output-hold-ms)")
    group.add_argument("--gil-switch-interval-ms", type=float, metavar="MS", default=LaunchConfig.gil_switch_interval_ms,
                       help="every stage process's GIL switch interval (sys.setswitchinterval): how long a thread "
                            "back from a GPU wait may wait for a thread busy in Python to hand the GIL over (an "
                            "engine's step thread, the stub's response thread); default: Python's own, 5 ms")
    group.add_argument("--stage-gc-freeze", choices=["on", "off"], default=on_off(LaunchConfig.stage_gc_freeze),
                       help="the thinker, talker, code2wav and orchestrator processes keep the objects their "
                            "loading left out of Python's garbage collection (gc.freeze): a full collection walks only "
                            "what serving allocated instead of stopping the stage's threads for a walk over the loaded "
                            "model (default: %(default)s)")


def add_load_arguments(group) -> None:
    """How streams are paced and admitted under load (docs/load.md)."""
    group.add_argument("--chunk-pacing", choices=CHUNK_PACING, default=LaunchConfig.chunk_pacing,
                       help="adaptive: each stream's audio chunks follow its frame rate and its listener's buffer "
                            "(decoded early when waiting would let the listener run dry, else growing to "
                            "--next-chunk-frames); ramp: the fixed ramp alone (default: %(default)s)")
    group.add_argument("--admission-queue", type=int, metavar="N",
                       help="requests that may wait for admission (FIFO; the wait counts in their TTFA); past it "
                            "a request is refused at once with UNAVAILABLE (default: the free slots, so that those "
                            "waiting and those running stay within --max-inflight)")
    group.add_argument("--admission-max-wait", type=_seconds, metavar="S", default=LaunchConfig.admission_max_wait,
                       help="a request that waited S seconds for admission is refused with UNAVAILABLE instead of "
                            "starting late (0: no limit; default: %(default)s)")
    group.add_argument("--admission-max-queue-wait", type=_seconds, metavar="S",
                       default=LaunchConfig.admission_max_queue_wait,
                       help="refuse at once, with UNAVAILABLE, a request whose expected wait for admission exceeds S "
                            "seconds, learned from the rate requests start out of the queue, before that from recent "
                            "streams' lifetimes and start lengths (nothing is refused so before either is learned); "
                            "pairs with --admission-max-wait, which refuses after waiting (0: no limit; default: "
                            "%(default)s)")
    group.add_argument("--admission-capacity", type=_admission_capacity, metavar="auto|off|AUDIO_S_PER_S",
                       help="admit a stream only while every running one keeps real time: auto (estimated from "
                            "the frame rate streams get, learned online), off (--max-inflight alone), or a fixed "
                            "capacity in audio-seconds per second (default: auto on cuda, off on cpu)")
    group.add_argument("--admission-max-starting", type=int, metavar="N",
                       help="streams admitted and not yet playing at once: a burst's starts are staggered so that "
                            "their prefills do not starve the streams already playing (0: no limit; default: 6 on "
                            "cuda, 0 on cpu)")


def _seconds(text: str) -> float:
    """A flag's seconds, checked as LaunchConfig checks them (argparse names the flag in its error)."""
    try:
        return seconds_setting("seconds", float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text!r}") from None


def _positive_int(text: str) -> int:
    return word_or_count(text, (), "a whole number")


def _hold_ms(text: str) -> float:
    """An output hold's milliseconds, checked as LaunchConfig checks them (argparse names the flag in its error)."""
    try:
        return hold_ms_setting("hold", float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be milliseconds within 0-1000, got {text!r}") from None


def _admission_capacity(text: str) -> str:
    try:
        admission_capacity_setting(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


# Orchestrator processes per pipeline on the GPU unless --instances names it: one process (one GIL) was the queue
# every hop through the orchestrator waited in at 64 streams on an H200, and a second one shortened a stream's start
# by 27% (requests/s 11.6 -> 13.6, TTFA p50 1832 -> 568 ms, none dry: benchmarks/results/h200-orchestrator-x2).
# The CPU path keeps one: its stages share the few cores a CPU host gives them.
DEFAULT_ORCHESTRATOR_INSTANCES_CUDA = 2


def add_placement_arguments(group) -> None:
    """--stage-gpus, --instances and --pipelines: where each stage runs (omni_triton.shared.placement)."""
    group.add_argument("--stage-gpus", type=_option_type(parse_stage_gpus), default={}, metavar="STAGE=GPUS,...",
                       help=f"cuda: the GPU(s) of each stage ({', '.join(GPU_STAGES)}), e.g. "
                            "thinker=0,talker=1,code2wav=1; several GPUs with ':' (talker=1:2); stages not named run "
                            "on GPU 0, the orchestrator on the thinker's (default: all on GPU 0)")
    group.add_argument("--instances", type=_option_type(parse_instances), default={}, metavar="STAGE=N,...",
                       help=f"instances of {', '.join(REPLICABLE_STAGES)} per GPU of the stage (Triton "
                            "instance_group count; the memory plan gives each its KV cache), e.g. "
                            "talker=2,code2wav=2; orchestrator=K: K orchestrator processes per pipeline, each taking "
                            "1/K of its admission limits (default: 1 each; on cuda the orchestrator "
                            f"x{DEFAULT_ORCHESTRATOR_INSTANCES_CUDA})")
    group.add_argument("--pipelines", type=int, default=Placement.pipelines, metavar="N",
                       help="whole pipelines (thinker, talker, code2wav) in this server, each on its own GPU group: "
                            "pipeline k on GPU k, or with --stage-gpus on that layout shifted by k groups; each "
                            "pipeline has its own orchestrator process, and a request stays on the pipeline of the "
                            "one that took it from admission to its last chunk; --max-inflight and the admission "
                            "limits count per pipeline (default: %(default)s)")


def _option_type(parse: Callable[[str], dict]) -> Callable[[str], dict]:
    def parse_argument(text: str) -> dict:
        try:
            return parse(text)
        except PlacementError as error:  # argparse shows an ArgumentTypeError's own message
            raise argparse.ArgumentTypeError(str(error)) from None
    return parse_argument


def stage_instances(device: str, given: dict[str, int]) -> dict[str, int]:
    """``--instances`` as given, with the device's defaults for the stages it does not name (on cuda: the
    orchestrator's, ``DEFAULT_ORCHESTRATOR_INSTANCES_CUDA``)."""
    instances = dict(given)
    if device == "cuda":
        instances.setdefault("orchestrator", DEFAULT_ORCHESTRATOR_INSTANCES_CUDA)
    return instances


def placement(args: argparse.Namespace) -> Placement:
    """The placement ``args`` give, with the GPU's default orchestrator instances where --instances does not name
    them (raises LaunchOptionError naming the option and value)."""
    if args.stage_gpus and args.device != "cuda":
        raise LaunchOptionError(f"--stage-gpus places stages on GPUs: it needs --device cuda (got --device "
                                f"{args.device})")
    try:
        return Placement(gpus=args.stage_gpus, instances=stage_instances(args.device, args.instances),
                         pipelines=args.pipelines)
    except PlacementError as error:
        raise LaunchOptionError(str(error)) from None


def model_source(args: argparse.Namespace, default_checkpoint: Callable[[], Path] | None = None) -> ModelSource:
    """The weights ``args`` name (raises LaunchOptionError for options that do not go together); without
    --checkpoint or --config, ``default_checkpoint()``."""
    if args.config and args.checkpoint:
        raise LaunchOptionError("give --checkpoint DIR or --config NAME_OR_DIR, not both")
    load_format = args.load_format or ("dummy" if args.config else "safetensors")
    if args.config and load_format != "dummy":
        raise LaunchOptionError(f"--config serves random weights: --load-format {load_format} needs --checkpoint")
    if args.dummy_layers is not None and not args.config:
        raise LaunchOptionError("--dummy-layers cuts a --config (a shipped name or a dir with config.json)")
    if args.dummy_layers is not None and args.dummy_layers < 1:
        raise LaunchOptionError(f"--dummy-layers must be >= 1, got {args.dummy_layers}")
    if args.config:
        from omni_triton.checkpoints.dummy import build

        try:
            checkpoint = build(args.config, layers=args.dummy_layers)
        except FileNotFoundError as error:
            raise LaunchOptionError(f"--config: {error}") from None
    elif args.checkpoint is not None:
        checkpoint = Path(args.checkpoint)
    elif default_checkpoint is not None:
        checkpoint = default_checkpoint()
    else:
        raise LaunchOptionError("give --checkpoint DIR or --config NAME_OR_DIR")
    return ModelSource(checkpoint, load_format, args.dummy_seed)


# planned from its flag and the GPU by the memory plan (with_kv_budget), not taken as given
PLANNED_SETTINGS = ("kv_cache_tokens", "talker_kv_cache_tokens")


def flag_settings(args: argparse.Namespace, ignored: tuple[str, ...] = ()) -> dict[str, Any]:
    """The LaunchConfig fields whose flag has the field's name (``--first-chunk-frames`` -> first_chunk_frames),
    an on/off flag as a bool: a new setting with such a flag reaches the config with no line here. ``ignored``: a
    command's flags of a field's name that mean something else there."""
    values = {}
    for setting in dataclasses.fields(LaunchConfig):
        if setting.name in PLANNED_SETTINGS + ignored or not hasattr(args, setting.name):
            continue
        value = getattr(args, setting.name)
        if setting.type in ("bool", "bool | None") and value in ("on", "off"):
            value = value == "on"
        values[setting.name] = value
    return values


def with_kv_budget(config: LaunchConfig, setting: int | str, utilization: float,
                   gpu_processes: int | None = None) -> tuple[LaunchConfig, str]:
    """``config`` with the engines' KV tokens of ``--kv-cache-tokens`` ``setting`` (``memory_plan.kv_budget``,
    per GPU of the config's placement: raises DoesNotFit), and the note saying the budget. ``gpu_processes``:
    1 for the in-process pipeline (default: as served)."""
    budget = kv_budget(setting, device=config.device, checkpoint_dir=config.checkpoint_dir,
                       dtype=config.resolved_dtype, utilization=utilization,
                       max_inflight=config.max_inflight_requests, code2wav_batch=config.code2wav_max_batch,
                       first_chunk_frames=config.first_chunk_frames, chunk_frames=config.next_chunk_frames,
                       left_context_frames=config.resolved_left_context_frames, block_size=config.kv_block_size,
                       gpu_processes=gpu_processes, placement=config.placement,
                       quantization=None if config.quantization == "none" else config.quantization)
    return replace(config, kv_cache_tokens=budget.thinker_tokens,
                   talker_kv_cache_tokens=budget.talker_tokens), budget.note


def left_context_setting(value: str) -> int | str:
    """``--left-context-frames``: stateful, exact or a frame count >= 1."""
    return word_or_count(value, ("stateful", "exact"), "a frame count")
