"""The launch settings: what a deployer chooses at `omni-triton serve`, as one typed object.

The launcher builds it from the flags (``launch/serve.py``) and writes it once, as JSON, into every model's
config.pbtxt (the ``settings`` parameter, ``launch/repository.py``); each stage stub reads the same object back
(``LaunchConfig.from_json``, through ``stages/model_args.launch_settings``). Defaults live here and nowhere else;
docs/settings.md says how to add a setting.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omni_triton.shared.placement import Placement

CPU_KV_CACHE_TOKENS = 16384  # the engines' KV budget on the CPU (the GPU's is planned: launch/memory_plan.py)
STAGES = ("preprocess", "orchestrator", "thinker", "talker", "code2wav")
# auto: the TensorRT plan when tensorrt imports and the engine file is a .plan on a GPU, else ONNX Runtime
# for a .onnx file, else torch
CODE2WAV_RUNTIMES = ("torch", "onnx", "trt", "auto")
# device: tensors between stages stay on the stage device (GPU tensors through Triton's CUDA pool).
# host: every tensor that crosses Triton is copied to host memory first. For Triton builds whose Python
# backend cannot carry GPU tensors through decoupled BLS streams (the nvidia-pytriton 0.7.0 bundle,
# Triton 2.51: hangs and crashes, see benchmarks/bls_gpu_repro); the hops then show in
# omni_interstage_host_tensors_total.
INTERSTAGE_MEMORY = ("device", "host")
# safetensors: the checkpoint's weights. dummy: seeded random weights built on the device from the checkpoint
# dir's config.json (omni_triton.models.weights), e.g. a dir written by omni_triton.checkpoints.dummy.
LOAD_FORMATS = ("safetensors", "dummy")
# models.layers.fast_kernels.LINEAR_LAUNCHES, spelled out so that launching imports no torch (a test keeps them equal)
LINEAR_LAUNCHES = ("one-pass", "split-k", "gemv")
# Weights quantized at load (none: the checkpoint's own; an FP8 checkpoint is served as FP8 either way); spelled
# out so that launching imports no torch: models.quantization.QUANTIZATIONS plus "none" (a test keeps them equal)
QUANTIZATIONS = ("none", "fp8")
# adaptive: each stream's chunk sizes follow its frame rate and its listener's buffer (pipeline/code2wav/pacing.py);
# ramp: ChunkPolicy's fixed ramp alone (4, 8, 24, 25, ...)
CHUNK_PACING = ("adaptive", "ramp")


@dataclass(frozen=True)
class LaunchConfig:
    """Everything a deployer chooses at launch; written into every model's config.pbtxt as JSON. A field's
    default is its flag's (the KV budget aside: planned from its flag); ``None`` means "chosen from other settings"
    (the ``resolved_*`` properties, which the launcher and the stages both read, so that both resolve it the same
    way)."""

    checkpoint_dir: Path
    device: str = "cpu"                   # cpu | cuda
    load_format: str = "safetensors"      # safetensors | dummy (see LOAD_FORMATS)
    dummy_seed: int = 0                   # load_format dummy: the weights' seed
    quantization: str = "none"            # none | fp8: thinker weights quantized at load (QUANTIZATIONS)
    interstage_memory: str = "device"     # device | host (see INTERSTAGE_MEMORY)
    dtype: str | None = None              # None: float32 on cpu, bfloat16 on cuda
    # Audio chunking: a small first chunk for a low time-to-first-audio, larger ones after it.
    first_chunk_frames: int = 4
    next_chunk_frames: int = 25
    # stateful: chunks carry new frames only, the code2wav stage keeps each stream's vocoder state (exact audio);
    # exact: each chunk re-decodes the vocoder's exact left context; a number: that many frames (inexact audio);
    # None: stateful with the torch runtime and one code2wav instance, exact otherwise (engine files are one-pass
    # unless exported --stateful, TensorRT keeps no state, and a stream's chunks must reach the instance that
    # holds its state)
    left_context_frames: int | str | None = None
    chunk_pacing: str = "adaptive"        # adaptive | ramp (see CHUNK_PACING)
    # Admission (stages/admission.py): requests that may wait for a start (None: the free slots, so that those
    # waiting and running stay within max_inflight_requests), for at most admission_max_wait seconds (0: no limit),
    # refused at once when their expected wait (stages/queue_drain.py: the queue's drain rate, before that recent
    # streams' lifetimes and start lengths) passes admission_max_queue_wait seconds (0: no limit; off by default: a
    # closed loop of up to max_inflight_requests clients is never refused), and
    # the real-time capacity that gates starts: "auto" (learned), "off" (max_inflight alone), or a fixed number of
    # audio-seconds per second; None: auto on cuda, off on cpu (a shared CPU's speed would make tests flaky).
    admission_queue: int | None = None
    admission_max_wait: float = 0.0
    admission_max_queue_wait: float = 0.0
    admission_capacity: str | None = None
    # streams admitted and not yet playing at once (their starts staggered; 0: no limit); None: 6 on cuda, 0 on cpu
    admission_max_starting: int | None = None
    kv_cache_tokens: int = CPU_KV_CACHE_TOKENS  # KV budget of the thinker (and of the talker, unless set), in tokens
    talker_kv_cache_tokens: int | None = None  # None: kv_cache_tokens
    kv_block_size: int = 16
    max_batched_tokens: int = 512         # per engine step: decode tokens + chunked-prefill tokens
    # CUDA only: the engines' Triton kernels + GPU sampling (fast_path) and CUDA-graph decode (cuda_graphs); the
    # CPU always runs the plain torch path
    fast_path: bool = True
    cuda_graphs: bool = True
    prefill_graphs: bool = True  # with both: steps with prefill rows as CUDA graphs too (engine.prefill_graphs)
    linear_launch: str = "gemv"  # with fast_path: the small linears (EngineConfig.linear_launch)
    dependent_launch: bool = True  # with fast_path on sm_90+: programmatic dependent launch (kernels.dependent_launch)
    overlap_steps: bool = True  # decode steps overlap their host work (EngineConfig.overlap_steps)
    prefix_caching: bool = True  # the engines reuse computed prompt prefixes (EngineConfig.prefix_caching)
    # thinker and talker send a stream's outputs a few steps at a time, none held longer than this (0: every step;
    # EngineConfig.output_batching)
    stage_output_hold_ms: float = 40.0
    # the thinker's outputs after its first 8 tokens: at least this many tokens a response, held at most
    # thinker_output_hold_ms (None: stage_output_hold_ms). Each response becomes a talker append request, and the
    # talker's request hop is its queue behind one execute per batch of them (issue 42): fewer, larger appends are
    # the experiment; 4 and 40 ms were the defaults before these settings
    thinker_tokens_per_output: int = 4
    thinker_output_hold_ms: float | None = None
    # Warm start: each stage runs every kernel shape and captures every CUDA graph that serving up to
    # max_inflight_requests streams will use before it reports ready. None: on for cuda, off for cpu.
    warmup: bool | None = None
    max_inflight_requests: int = 16       # per stage: engine batch and sequence-batcher slots
    max_text_chars: int = 8000
    max_audio_seconds: float = 60.0
    max_tokens_cap: int = 2048
    default_max_tokens: int = 256
    max_audio_frames_cap: int = 4096
    torch_threads: dict[str, int] = field(default_factory=lambda: {stage: 1 for stage in STAGES})
    code2wav_runtime: str = "torch"       # torch | onnx | trt | auto
    code2wav_engine_path: Path | None = None  # the .onnx file or TensorRT .plan for onnx | trt
    code2wav_max_batch: int = 8
    # the code2wav stage's execute returns once the previous call's decode is done, not its own: the next call's
    # host work (Triton's batch, parsing, launches) runs while this one decodes (stages/decode_pacing.py)
    code2wav_overlap: bool = False
    # torch code2wav on a GPU: cuDNN times its algorithms for each convolution shape and keeps the fastest (once per
    # shape, before its CUDA graph's capture) instead of its heuristic's pick, which for this vocoder's bf16 dilated
    # convolutions is a slow generic kernel. Off: the dilated phases below get the same speed from the heuristic
    # without the timing's ~95 s of stage start (benchmarks/results/h200-code2wav-switches)
    code2wav_cudnn_autotune: bool = False
    # torch code2wav on a GPU: its dilated convolutions as undilated ones over the input's phases
    # (models/code2wav/phase_conv.py), a shape cuDNN's heuristic serves with a tensor-core kernel without timing
    # (0.78x GPU time a call at batch 8 on an H200, as the timed picks' 0.74x)
    code2wav_dilated_phases: bool = True
    # torch code2wav on a GPU: each SnakeBeta activation as one fused Triton kernel (kernels/snake.py) instead of
    # torch's five to six elementwise launches (with the phases: 0.58x GPU time a call at batch 8 on an H200)
    code2wav_triton_snake: bool = True
    # every stage process's GIL switch interval (sys.setswitchinterval), in ms; None: Python's own (5 ms). A thread
    # that waited with the GIL released (an engine's step thread on its step's sampled ids) may wait this long to get
    # it back from a thread busy in Python (the stub's response sends): benchmarks/gil_switch_probe.py
    gil_switch_interval_ms: float | None = None
    # thinker, talker, code2wav and orchestrator: once loaded (warm-up included), the objects loading left are kept
    # out of garbage collection (gc.freeze, stages/collector.py): a full collection then walks only what serving
    # allocated, instead of holding every thread of the stub for ~200 ms at full size (the talker's, on an H200)
    stage_gc_freeze: bool = True
    placement: Placement = field(default_factory=Placement)  # GPUs, instances, pipelines (see placement.py)

    def __post_init__(self):
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if self.linear_launch not in LINEAR_LAUNCHES:
            raise ValueError(f"linear_launch must be one of {LINEAR_LAUNCHES}, got {self.linear_launch!r}")
        if self.interstage_memory not in INTERSTAGE_MEMORY:
            raise ValueError(f"interstage_memory must be one of {INTERSTAGE_MEMORY}, got {self.interstage_memory!r}")
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}")
        if self.code2wav_runtime not in CODE2WAV_RUNTIMES:
            raise ValueError(f"code2wav_runtime must be one of {CODE2WAV_RUNTIMES}, got {self.code2wav_runtime!r}")
        if self.left_context_frames == "stateful" and self.code2wav_instances > 1:
            # Triton sends each code2wav call to any instance; only the one that holds a stream's state can decode
            # its next chunk
            raise ValueError(f"left_context_frames 'stateful' needs one code2wav instance (the stream's state lives "
                             f"in it), got {self.code2wav_instances}: use 'exact' or a frame count with more")
        if self.code2wav_runtime == "trt" and self.left_context_frames == "stateful":
            raise ValueError("code2wav_runtime trt keeps no streaming state: use left_context_frames exact or a "
                             "frame count with it (--left-context-frames), or the torch / onnx runtime")
        if self.gil_switch_interval_ms is not None and not 0 < self.gil_switch_interval_ms <= 1000:
            raise ValueError(f"gil_switch_interval_ms must be > 0 and <= 1000 (or None: Python's own), "
                             f"got {self.gil_switch_interval_ms!r}")
        if self.code2wav_runtime in ("onnx", "trt") and self.code2wav_engine_path is None:
            raise ValueError(f"code2wav_runtime {self.code2wav_runtime} needs code2wav_engine_path")
        for name in ("first_chunk_frames", "next_chunk_frames", "kv_cache_tokens", "kv_block_size",
                     "max_batched_tokens", "max_inflight_requests", "max_tokens_cap", "default_max_tokens",
                     "code2wav_max_batch", "thinker_tokens_per_output"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.talker_kv_cache_tokens is not None and self.talker_kv_cache_tokens < 1:
            raise ValueError(f"talker_kv_cache_tokens must be >= 1, got {self.talker_kv_cache_tokens}")
        if self.left_context_frames not in (None, "stateful", "exact") and (
                not isinstance(self.left_context_frames, int) or self.left_context_frames < 1):
            raise ValueError(f"left_context_frames must be 'stateful', 'exact' or >= 1, got {self.left_context_frames!r}")
        for name in ("stage_output_hold_ms", "thinker_output_hold_ms"):
            if getattr(self, name) is not None:
                hold_ms_setting(name, getattr(self, name))
        if self.chunk_pacing not in CHUNK_PACING:
            raise ValueError(f"chunk_pacing must be one of {CHUNK_PACING}, got {self.chunk_pacing!r}")
        if self.admission_queue is not None and self.admission_queue < 0:
            raise ValueError(f"admission_queue must be >= 0, got {self.admission_queue}")
        for name in ("admission_max_wait", "admission_max_queue_wait"):
            seconds_setting(name, getattr(self, name))
        if self.admission_capacity is not None:
            admission_capacity_setting(self.admission_capacity)
        if self.admission_max_starting is not None and self.admission_max_starting < 0:
            raise ValueError(f"admission_max_starting must be >= 0, got {self.admission_max_starting}")
        if not 1 <= self.default_max_tokens <= self.max_tokens_cap:
            raise ValueError(f"default_max_tokens must be in [1, max_tokens_cap={self.max_tokens_cap}], "
                             f"got {self.default_max_tokens}")

    def to_json(self) -> str:
        """The settings as one line of JSON (paths as strings; ``from_json`` reads it back)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        values["placement"] = {"gpus": {stage: list(ids) for stage, ids in self.placement.gpus.items()},
                               "instances": dict(self.placement.instances), "pipelines": self.placement.pipelines}
        return json.dumps(values, default=str, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> LaunchConfig:
        """The settings ``to_json`` wrote (validated again: a hand-edited repository fails here, naming the field)."""
        values: dict[str, Any] = json.loads(text)
        unknown = sorted(set(values) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"launch settings: unknown field {unknown[0]!r} (written by another omni-triton?)")
        placement = values.pop("placement", {})
        values["placement"] = Placement(gpus={stage: tuple(ids) for stage, ids in placement.get("gpus", {}).items()},
                                        instances=placement.get("instances", {}),
                                        pipelines=placement.get("pipelines", 1))
        for name in ("checkpoint_dir", "code2wav_engine_path"):
            if values.get(name) is not None:
                values[name] = Path(values[name])
        return cls(**values)

    def threads_of(self, stage: str) -> int:
        """torch threads of ``stage``'s process (1 for a stage ``torch_threads`` does not name)."""
        return self.torch_threads.get(stage, 1)

    @property
    def resolved_left_context_frames(self) -> int | str:
        if self.left_context_frames is None:
            return "stateful" if self.code2wav_runtime == "torch" and self.code2wav_instances == 1 else "exact"
        return self.left_context_frames

    @property
    def code2wav_instances(self) -> int:
        """Of one pipeline: a stream's chunks stay on its pipeline's code2wav."""
        return self.placement.count("code2wav") * len(self.placement.gpus_of("code2wav"))

    @property
    def resolved_dtype(self) -> str:
        return self.dtype or ("bfloat16" if self.device == "cuda" else "float32")

    @property
    def resolved_admission_max_starting(self) -> int:
        if self.admission_max_starting is not None:
            return self.admission_max_starting
        return DEFAULT_MAX_STARTING_CUDA if self.device == "cuda" else 0

    @property
    def resolved_admission_capacity(self) -> str:
        return self.admission_capacity or ("auto" if self.device == "cuda" else "off")

    @property
    def resolved_warmup(self) -> bool:
        return self.device == "cuda" if self.warmup is None else self.warmup

    @property
    def resolved_talker_kv_cache_tokens(self) -> int:
        return self.talker_kv_cache_tokens or self.kv_cache_tokens


DEFAULT_MAX_STARTING_CUDA = 6  # starts at once on a GPU (stages/admission.py; benchmarks/results/h200-load: 0 of 128 dry at 64)


def on_off(value: bool) -> str:
    """A bool setting as its flag spells it."""
    return "on" if value else "off"


def seconds_setting(name: str, seconds: float) -> float:
    """A number of seconds >= 0 and finite (0: no limit), else ValueError naming the setting."""
    if not 0 <= seconds < math.inf:
        raise ValueError(f"{name} must be >= 0 seconds, got {seconds}")
    return seconds


def hold_ms_setting(name: str, ms: float) -> float:
    """An output hold in milliseconds within 0-1000, else ValueError naming the setting."""
    if not 0 <= ms <= 1000:
        raise ValueError(f"{name} must be within 0-1000, got {ms}")
    return ms


def admission_capacity_setting(text: str) -> float | str:
    """``--admission-capacity``: "auto", "off", or audio-seconds per second > 0 (ValueError naming it)."""
    if text in ("auto", "off"):
        return text
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(f"admission_capacity must be auto, off or audio-seconds per second > 0, got {text!r}")
    return value
