"""How many KV-cache tokens fit the GPU: ``--kv-cache-tokens auto``.

Planned before tritonserver starts, so that every stage (preprocess too: it refuses requests the talker's cache
cannot hold) gets the same fixed numbers, and a pipeline that cannot fit fails at once with a message instead
of an out-of-memory error inside one stage while the others load in parallel. From the memory free on the GPU
then, times ``utilization`` (headroom for fragmentation), go:

- the weights of thinker (+ audio encoder), talker and code2wav: counted from config.json on the meta
  device, exact;
- the vocoder's activations for its largest call (``code2wav_max_batch`` chunks of left context + chunk
  frames): ``CODE2WAV_LIVE_TENSORS`` tensors of its widest stage per frame. Measured 13 in fp32 on the CPU at
  the released widths (9.1 MiB per frame, peak RSS); 16 leaves room;
- ``GPU_PROCESS_BYTES`` per process on the GPU (CUDA context, kernels, cuBLAS workspace: tritonserver and
  the thinker, talker, code2wav and orchestrator stubs) and ``ENGINE_STEP_BYTES`` per engine (one step's
  activations, logits, sampler state): allowances, not measurements.

With stages on several GPUs, or several instances of a stage (``placement.py``), each GPU is planned from what it
holds: the weights, processes, engine steps and vocoder activations of every instance on it, and what is left
shared by the engine instances there. What is left is KV cache: ``THINKER_KV_SHARE`` of the bytes the thinker's, the rest the talker's (at the
released dimensions a thinker token takes 96 KiB and a talker token 20 KiB, so the talker gets about twice
the thinker's tokens: spoken answers are longer in codec frames than in text tokens). Each engine is capped
at ``max_inflight`` requests of its longest context. On the CPU the default stays ``CPU_KV_CACHE_TOKENS``, and
a model whose weights exceed the host memory available (the full-size config in fp32: 129 GiB) is refused.
"""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

from omni_triton.shared.placement import ENGINE_STAGES, REPLICABLE_STAGES, Placement
from omni_triton.shared.settings import CPU_KV_CACHE_TOKENS

if TYPE_CHECKING:  # torch is imported where a footprint is measured: `omni-triton --help` stays quick
    import torch

GIB = 1 << 30
GPU_PROCESS_BYTES = 3 * GIB // 4
ENGINE_STEP_BYTES = 3 * GIB // 2
CODE2WAV_LIVE_TENSORS = 16
THINKER_KV_SHARE = 0.7
DEFAULT_UTILIZATION = 0.95
MIN_KV_TOKENS = 4096  # per engine: below it the pipeline serves a few short requests at most
TOKENS_PER_REQUEST_HINT = 1024  # what a --dummy-layers suggestion leaves room for, per --max-inflight request
SERVED_GPU_PROCESSES = 5  # tritonserver + the thinker, talker, code2wav and orchestrator stubs


class DoesNotFit(ValueError):
    pass


@dataclass(frozen=True)
class Footprint:
    """What the model takes on the GPU, from its config.json: bytes of weights (per thinker/talker layer too,
    for cutting layers), KV bytes per token, vocoder activation bytes per frame."""

    thinker_bytes: int           # thinker + audio encoder
    talker_bytes: int            # talker + code predictor
    code2wav_bytes: int
    thinker_layer_bytes: int
    talker_layer_bytes: int
    thinker_layers: int
    talker_layers: int
    thinker_kv_token_bytes: int
    talker_kv_token_bytes: int
    # the accept-layer hidden state the prefix cache keeps beside each thinker KV slot (engine.kept_states);
    # planned with the KV whether the cache is on or not (4% of the full-size thinker's KV)
    thinker_kept_state_token_bytes: int
    code2wav_frame_bytes: int    # activations per decoded frame and batch row
    code2wav_stream_bytes: int   # one audio stream's vocoder state (--left-context-frames stateful)
    thinker_context: int         # max_position_embeddings
    talker_context: int
    exact_left_context_frames: int

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str | Path, dtype: torch.dtype,
                        quantization: str | None = None) -> "Footprint":
        """``quantization`` "fp8" (or a checkpoint with an FP8 quantization_config): the FP8 modules of the
        components served in FP8 (``quantization.served_in_fp8``: the thinker) count one byte a weight plus their
        fp32 block scales; the talker counts in ``dtype``, as the loader serves it."""
        import torch

        from omni_triton.models.audio_encoder import AudioEncoder
        from omni_triton.models.code2wav.vocoder import Code2Wav, exact_left_context_frames
        from omni_triton.models.code2wav.stateful import StreamingCode2Wav
        from omni_triton.models.config import OmniConfig
        from omni_triton.models.talker import Talker
        from omni_triton.models.thinker import Thinker

        config = OmniConfig.from_pretrained(checkpoint_dir)
        element = torch.empty((), dtype=dtype).element_size()
        with torch.device("meta"):
            thinker, audio = Thinker(config.thinker), AudioEncoder(config.thinker.audio)
            talker, code2wav = Talker(config.talker), Code2Wav(config.code2wav)
            _quantize_like_the_loader(checkpoint_dir, quantization, {"thinker": thinker, "talker": talker})
        thinker_text, talker_text = config.thinker.text, config.talker.text
        return cls(
            thinker_bytes=_bytes(thinker, element) + _bytes(audio, element), talker_bytes=_bytes(talker, element),
            code2wav_bytes=_bytes(code2wav, element),
            thinker_layer_bytes=_bytes(thinker, element, "model.layers.") // thinker_text.num_layers,
            talker_layer_bytes=_bytes(talker, element, "model.layers.") // talker_text.num_layers,
            thinker_layers=thinker_text.num_layers, talker_layers=talker_text.num_layers,
            thinker_kv_token_bytes=_kv_token_bytes(thinker_text, dtype),
            talker_kv_token_bytes=_kv_token_bytes(talker_text, dtype),
            thinker_kept_state_token_bytes=thinker_text.hidden_size * element,
            code2wav_frame_bytes=_code2wav_widest_per_frame(config.code2wav) * element * CODE2WAV_LIVE_TENSORS,
            code2wav_stream_bytes=sum(math.prod(spec.shape) for spec in StreamingCode2Wav(code2wav).state_specs())
            * element,
            thinker_context=int(thinker_text.raw.get("max_position_embeddings", 32768)),
            talker_context=int(talker_text.raw.get("max_position_embeddings", 32768)),
            exact_left_context_frames=exact_left_context_frames(config.code2wav),
        )

    def with_layers(self, layers: int) -> "Footprint":
        """The footprint with thinker and talker cut to at most ``layers`` layers (``--dummy-layers``)."""
        thinker_layers, talker_layers = min(layers, self.thinker_layers), min(layers, self.talker_layers)
        return replace(
            self, thinker_layers=thinker_layers, talker_layers=talker_layers,
            thinker_bytes=self.thinker_bytes - (self.thinker_layers - thinker_layers) * self.thinker_layer_bytes,
            talker_bytes=self.talker_bytes - (self.talker_layers - talker_layers) * self.talker_layer_bytes,
            thinker_kv_token_bytes=self.thinker_kv_token_bytes * thinker_layers // self.thinker_layers,
            talker_kv_token_bytes=self.talker_kv_token_bytes * talker_layers // self.talker_layers)

    @property
    def weight_bytes(self) -> int:
        return self.thinker_bytes + self.talker_bytes + self.code2wav_bytes


def _bytes(module: torch.nn.Module, element: int, prefix: str = "") -> int:
    """Bytes of the floating-point tensors under ``prefix``: ``element`` each, FP8 weights one, scales four."""
    import torch

    tensors = [*module.named_parameters(), *module.named_buffers()]
    return sum(t.numel() * (1 if t.dtype == torch.float8_e4m3fn else 4 if name.endswith("_scale_inv") else element)
               for name, t in tensors if name.startswith(prefix) and t.is_floating_point())


def _quantize_like_the_loader(checkpoint_dir: str | Path, quantization: str | None,
                              components: dict[str, torch.nn.Module]) -> None:
    """The FP8 twins the loader builds (``models.weights``) in the components it serves in FP8, by the
    quantize-at-load rule: the plan's estimate of an FP8 checkpoint that converts other modules is off by their
    bytes only."""
    from omni_triton.models.layers.fp8 import quantize_modules_
    from omni_triton.models.quantization import Fp8Scheme, check_quantization, checkpoint_scheme, \
        quantized_at_load, served_in_fp8

    check_quantization(quantization)
    scheme = checkpoint_scheme(checkpoint_dir) or (Fp8Scheme() if quantization == "fp8" else None)
    for component, model in components.items() if scheme is not None else ():
        if served_in_fp8(component):
            quantize_modules_(model, scheme, quantized_at_load)


def _kv_token_bytes(text, dtype: torch.dtype) -> int:
    from omni_triton.engine.block_manager import kv_bytes_per_block

    return kv_bytes_per_block(1, text.num_layers, text.num_kv_heads, text.head_dim, dtype)


def _code2wav_widest_per_frame(config) -> int:
    """Elements per codec frame of the vocoder's widest activation: a ConvNeXt block's 4x expansion after the
    upsampling, or a decoder block's output (channels halve as the time axis grows by each rate)."""
    time = math.prod(config.upsampling_ratios)
    widest = 4 * config.hidden_size * time
    channels = config.decoder_dim
    for rate in config.upsample_rates:
        channels, time = channels // 2, time * rate
        widest = max(widest, channels * time)
    return widest


@dataclass(frozen=True)
class GpuPlan:
    """One GPU of a plan: what it holds and the KV tokens each engine instance on it gets."""

    gpu: int
    device_name: str
    free_bytes: int
    held: dict[str, int]             # stage -> instances on this GPU
    weight_bytes: int
    reserved_bytes: int              # processes + engine steps + vocoder activations
    code2wav_activation_bytes: int
    kv_bytes: int                    # what is left for the KV caches (negative: over by that much)
    thinker_tokens: int | None       # per thinker instance here (None: none here)
    talker_tokens: int | None        # per talker instance here

    def fits(self) -> bool:
        engines = [t for t in (self.thinker_tokens, self.talker_tokens) if t is not None]
        return self.kv_bytes >= 0 and all(tokens >= MIN_KV_TOKENS for tokens in engines)

    def holds(self) -> str:
        return " + ".join(f"{stage} x{count}" for stage, count in self.held.items())


@dataclass(frozen=True)
class MemoryPlan:
    utilization: float
    footprint: Footprint
    gpus: tuple[GpuPlan, ...]
    thinker_tokens: int              # per engine instance: the least any GPU gives (one value per stage config)
    talker_tokens: int

    @property
    def device_name(self) -> str:
        return self.gpus[0].device_name

    @property
    def reserved_bytes(self) -> int:
        return sum(gpu.reserved_bytes for gpu in self.gpus)

    @property
    def thinker_kv_bytes(self) -> int:
        return self.thinker_tokens * (self.footprint.thinker_kv_token_bytes
                                      + self.footprint.thinker_kept_state_token_bytes)

    @property
    def talker_kv_bytes(self) -> int:
        return self.talker_tokens * self.footprint.talker_kv_token_bytes

    def describe(self) -> str:
        f = self.footprint
        lines = [f"GPU memory, {self.utilization:.0%} of what is free at launch planned; weights: thinker "
                 f"{f.thinker_layers} layers {_gib(f.thinker_bytes)}, talker {f.talker_layers} layers "
                 f"{_gib(f.talker_bytes)}, code2wav {_gib(f.code2wav_bytes)} per instance"]
        for gpu in self.gpus:
            lines.append(f"  GPU {gpu.gpu} ({gpu.device_name}): {_gib(gpu.free_bytes)} free, holds {gpu.holds()}: "
                         f"weights {_gib(gpu.weight_bytes)}, reserved {_gib(gpu.reserved_bytes)} (vocoder "
                         f"activations {_gib(gpu.code2wav_activation_bytes)}, CUDA contexts and engine steps), "
                         f"KV {_gib(max(gpu.kv_bytes, 0))}")
        lines.append(f"  KV cache: thinker {self.thinker_tokens} tokens = {_gib(self.thinker_kv_bytes)}, "
                     f"talker {self.talker_tokens} tokens = {_gib(self.talker_kv_bytes)} (per instance)")
        return "\n".join(lines)


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GIB:.1f} GiB"


def plan(footprint: Footprint, free_bytes: int, *, utilization: float = DEFAULT_UTILIZATION,
         gpu_processes: int | None = SERVED_GPU_PROCESSES, max_inflight: int = 16, code2wav_batch: int = 8,
         code2wav_frames: int | None = None, code2wav_streams: int = 0, block_size: int = 16,
         device_name: str = "GPU", layers_hint: bool = True) -> MemoryPlan:
    """``plan_placement`` for every stage on one GPU with ``free_bytes`` free."""
    return plan_placement(footprint, {0: (free_bytes, device_name)}, Placement(), utilization=utilization,
                          gpu_processes=gpu_processes, max_inflight=max_inflight, code2wav_batch=code2wav_batch,
                          code2wav_frames=code2wav_frames, code2wav_streams=code2wav_streams, block_size=block_size,
                          layers_hint=layers_hint)


def plan_placement(footprint: Footprint, gpus: Mapping[int, tuple[int, str]], placement: Placement, *,
                   utilization: float = DEFAULT_UTILIZATION, gpu_processes: int | None = None,
                   max_inflight: int = 16, code2wav_batch: int = 8, code2wav_frames: int | None = None,
                   code2wav_streams: int = 0, block_size: int = 16, layers_hint: bool = True) -> MemoryPlan:
    """The KV budget of each engine instance when the stages sit on GPUs as ``placement`` says; ``gpus``: GPU id
    -> (bytes free, name). Each GPU is planned from what it holds (see the module doc; several instances on one
    GPU share what is left, the thinker's share going to the thinker when it is there too); each engine then
    gets the least any of its GPUs gives. ``gpu_processes``: CUDA processes on each GPU (None: as served,
    tritonserver + the orchestrator + the stage instances there; 1: the in-process pipeline). ``code2wav_frames``:
    frames of the vocoder's largest call (default: exact left context + 25). ``code2wav_streams``: vocoder states
    each code2wav instance holds at most (stateful chunks: the stage's slots). Raises DoesNotFit, naming the GPU,
    what it holds and what would fit (and, with ``layers_hint``, the most layers that fit), when a GPU is over or
    an engine would get fewer than ``MIN_KV_TOKENS`` tokens."""
    if not 0 < utilization <= 1:
        raise ValueError(f"utilization must be in (0, 1], got {utilization}")
    check_visible(gpus, placement)
    frames = code2wav_frames or footprint.exact_left_context_frames + 25
    sizing = dict(utilization=utilization, gpu_processes=gpu_processes, max_inflight=max_inflight,
                  code2wav_batch=code2wav_batch, frames=frames, code2wav_streams=code2wav_streams,
                  block_size=block_size, orchestrators=placement.count("orchestrator"))
    per_gpu = tuple(_plan_gpu(footprint, gpu, *gpus[gpu], placement.held(gpu), **sizing)
                    for gpu in placement.used_gpus())
    over = [gpu for gpu in per_gpu if not gpu.fits()]
    if not over:
        thinker, talker = ([getattr(gpu_plan, f"{stage}_tokens") for gpu_plan in per_gpu if stage in gpu_plan.held]
                           for stage in ENGINE_STAGES)
        return MemoryPlan(utilization, footprint, per_gpu, min(thinker), min(talker))
    gpu = over[0]
    message = (f"the placement does not fit GPU {gpu.gpu} ({gpu.device_name}): {_gib(gpu.free_bytes)} free, "
               f"{utilization:.0%} of it planned; it holds {gpu.holds()}: weights {_gib(gpu.weight_bytes)} + "
               f"reserved {_gib(gpu.reserved_bytes)} (vocoder activations {_gib(gpu.code2wav_activation_bytes)} "
               f"for {code2wav_batch} x {frames} frames per code2wav instance) leave {_gib(max(gpu.kv_bytes, 0))} "
               f"for the KV caches, under {MIN_KV_TOKENS} tokens per engine")
    fewer = _fewer_instances_that_fit(footprint, gpu, sizing)
    if fewer is not None:
        message += (f"; on GPU {gpu.gpu} fits: {' + '.join(f'{s} x{n}' for s, n in fewer.items())} "
                    f"(--instances {','.join(f'{s}={n}' for s, n in fewer.items() if s in REPLICABLE_STAGES)})")
    elif len(gpu.held) > 1 and len(gpus) > 1:
        message += "; or spread the stages over more GPUs (--stage-gpus)"
    if layers_hint:
        fitting = [n for n in range(footprint.thinker_layers - 1, 0, -1)
                   if _fits(footprint.with_layers(n), gpus, placement, sizing)]
        if fitting:
            message += (f"; random weights of {fitting[0]} layers fit (--config ... --dummy-layers {fitting[0]}), "
                        f"with room for --max-inflight {max_inflight} requests of {TOKENS_PER_REQUEST_HINT} tokens")
    raise DoesNotFit(message + "; or lower --left-context-frames / --code2wav-max-batch (vocoder activations), "
                               "--max-inflight, or raise --gpu-memory-utilization")


def check_visible(gpus: Mapping[int, object], placement: Placement) -> None:
    invisible = [gpu for gpu in placement.used_gpus() if gpu not in gpus]
    if invisible:
        option = (f"--pipelines {placement.pipelines} ({placement.group_size} GPU(s) each: "
                  f"{placement.pipelines * placement.group_size} GPUs)" if placement.pipelines > 1 else "--stage-gpus")
        raise DoesNotFit(f"{option}: GPU {invisible[0]} is not visible here ({len(gpus)} GPU(s): ids "
                         f"{', '.join(map(str, sorted(gpus)))}); placement {placement.describe()}")


def _plan_gpu(footprint: Footprint, gpu: int, free_bytes: int, device_name: str, held: dict[str, int], *,
              utilization: float, gpu_processes: int | None, max_inflight: int, code2wav_batch: int, frames: int,
              code2wav_streams: int, block_size: int, orchestrators: int = 1) -> GpuPlan:
    stage_bytes = {"thinker": footprint.thinker_bytes, "talker": footprint.talker_bytes,
                   "code2wav": footprint.code2wav_bytes, "orchestrator": 0}
    weights = sum(stage_bytes[stage] * count for stage, count in held.items())
    # an orchestrator handles its pipeline's tensors, so it holds a CUDA context on each GPU of its pipeline, its
    # own or not (``orchestrators`` per pipeline: placement.held counts them on their own GPU)
    processes = gpu_processes or (1 + sum(held.values()) + ("orchestrator" not in held) * orchestrators)
    engines = held.get("thinker", 0) + held.get("talker", 0)
    activations = (footprint.code2wav_frame_bytes * frames * code2wav_batch
                   + footprint.code2wav_stream_bytes * code2wav_streams) * held.get("code2wav", 0)
    reserved = processes * GPU_PROCESS_BYTES + engines * ENGINE_STEP_BYTES + activations
    kv_bytes = int(free_bytes * utilization) - weights - reserved
    left = max(kv_bytes, 0)
    thinker_bytes = int(left * THINKER_KV_SHARE) if "talker" in held else left
    tokens = {}
    for stage, budget in (("thinker", thinker_bytes), ("talker", left - thinker_bytes if "thinker" in held else left)):
        if stage in held:
            token_bytes = getattr(footprint, f"{stage}_kv_token_bytes") + (
                footprint.thinker_kept_state_token_bytes if stage == "thinker" else 0)
            context = getattr(footprint, f"{stage}_context")
            fitted = min(budget // held[stage] // token_bytes, max_inflight * context)
            tokens[stage] = fitted // block_size * block_size
    return GpuPlan(gpu, device_name, free_bytes, held, weights, reserved, activations, kv_bytes,
                   tokens.get("thinker"), tokens.get("talker"))


def _fewer_instances_that_fit(footprint: Footprint, gpu: GpuPlan, sizing: dict) -> dict[str, int] | None:
    """The most instances of the replicable stages (at least one each) that fit ``gpu``, with what else it
    holds; None when one each does not fit either, or when there is nothing to take away."""
    counts = [range(gpu.held[stage], 0, -1) if stage in REPLICABLE_STAGES else (gpu.held[stage],)
              for stage in gpu.held]
    options = sorted(itertools.product(*counts), key=sum, reverse=True)
    for option in options[1:]:
        held = dict(zip(gpu.held, option))
        if _plan_gpu(footprint, gpu.gpu, gpu.free_bytes, gpu.device_name, held, **sizing).fits():
            return held
    return None


def _fits(footprint: Footprint, gpus: Mapping[int, tuple[int, str]], placement: Placement, sizing: dict) -> bool:
    plans = [_plan_gpu(footprint, gpu, *gpus[gpu], placement.held(gpu), **sizing) for gpu in placement.used_gpus()]
    return all(p.fits() for p in plans) and all(
        p.thinker_tokens >= sizing["max_inflight"] * TOKENS_PER_REQUEST_HINT for p in plans if "thinker" in p.held)


def gpu_memory() -> dict[int, tuple[int, str]]:
    """GPU id -> (bytes free, name and size) for every visible GPU, read in a child process so that this one
    holds no CUDA context while the server runs."""
    probe = ("import json, torch\n"
             "gpus = [(*torch.cuda.mem_get_info(i), torch.cuda.get_device_name(i)) "
             "for i in range(torch.cuda.device_count())]\n"
             "print(json.dumps(gpus))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    gpus = json.loads(result.stdout) if result.returncode == 0 and result.stdout.strip() else []
    if not gpus:
        raise DoesNotFit(f"cannot read the free GPU memory (no CUDA device visible to torch?): "
                         f"{result.stderr.strip()[-500:]}; pass --kv-cache-tokens N")
    return {index: (int(free), f"{name}, {total / GIB:.0f} GiB") for index, (free, total, name) in enumerate(gpus)}


def host_memory_available() -> int | None:
    try:
        line = next(line for line in Path("/proc/meminfo").read_text().splitlines() if line.startswith("MemAvailable"))
    except (OSError, StopIteration):
        return None
    return int(line.split()[1]) * 1024


@dataclass(frozen=True)
class KvBudget:
    thinker_tokens: int
    talker_tokens: int
    note: str  # what the launch prints: the budget and where it came from


def kv_budget(setting: int | str, *, device: str, checkpoint_dir: str | Path, dtype: str, utilization: float,
              max_inflight: int, code2wav_batch: int, first_chunk_frames: int, chunk_frames: int,
              left_context_frames: int | str | None, block_size: int = 16, gpu_processes: int | None = None,
              placement: Placement = Placement(), quantization: str | None = None) -> KvBudget:
    """The engines' KV tokens for ``--kv-cache-tokens`` ``setting`` (``auto`` or a number). On cuda ``auto`` is
    ``plan_placement`` over the memory free now on each GPU of ``placement`` (raises DoesNotFit); a number is
    taken as it is, with its size and, where it exceeds the plan, a warning in the note. A GPU the placement
    names that is not visible is refused either way."""
    import torch

    footprint = Footprint.from_checkpoint(checkpoint_dir, getattr(torch, dtype), quantization)
    if device != "cuda":
        available = host_memory_available()
        if available is not None and footprint.weight_bytes > available:
            raise DoesNotFit(f"the weights take {_gib(footprint.weight_bytes)} in {dtype}, more than the "
                             f"{_gib(available)} of host memory available: serve this model with --device cuda")
        tokens = CPU_KV_CACHE_TOKENS if setting == "auto" else int(setting)
        return KvBudget(tokens, tokens, f"KV cache: {tokens} tokens per engine")
    from omni_triton.pipeline.code2wav.chunking import ChunkPolicy

    policy = ChunkPolicy.from_setting(first_chunk_frames, chunk_frames, left_context_frames)
    frames = policy.resolved(footprint.exact_left_context_frames).max_frames_per_call()
    gpus = gpu_memory()
    # stateful chunks: the state slots double when full: room for twice the streams in flight
    arguments = dict(utilization=utilization, gpu_processes=gpu_processes, max_inflight=max_inflight,
                     code2wav_batch=code2wav_batch, code2wav_frames=frames, block_size=block_size,
                     code2wav_streams=2 * max_inflight if policy.stateful else 0)
    if setting == "auto":
        fitted = plan_placement(footprint, gpus, placement, **arguments)
        return KvBudget(fitted.thinker_tokens, fitted.talker_tokens, "--kv-cache-tokens auto: " + fitted.describe())
    tokens = int(setting)
    note = (f"KV cache (--kv-cache-tokens {tokens}): thinker {_gib(tokens * footprint.thinker_kv_token_bytes)}, "
            f"talker {_gib(tokens * footprint.talker_kv_token_bytes)} per instance")
    check_visible(gpus, placement)
    try:
        fitted = plan_placement(footprint, gpus, placement, layers_hint=False, **arguments)
    except DoesNotFit as error:
        return KvBudget(tokens, tokens, f"{note}\n  warning: {error}")
    if tokens > min(fitted.thinker_tokens, fitted.talker_tokens):
        note += (f"\n  warning: more than fits by the plan of --kv-cache-tokens auto "
                 f"(thinker {fitted.thinker_tokens}, talker {fitted.talker_tokens} tokens): expect out-of-memory")
    return KvBudget(tokens, tokens, note)


def kv_tokens_setting(text: str) -> int | str:
    """argparse type of ``--kv-cache-tokens``: ``auto`` or a number of tokens >= 1."""
    return word_or_count(text, ("auto",), "a number of tokens")


def word_or_count(text: str, words: tuple[str, ...], count: str) -> int | str:
    """argparse type of a setting that is one of ``words`` (maybe none) or a ``count`` >= 1."""
    if text in words:
        return text
    try:
        number = int(text)
    except ValueError:
        number = 0
    if number < 1:
        import argparse

        either = f"{', '.join(words)} or " if words else ""
        raise argparse.ArgumentTypeError(f"expected {either}{count} >= 1, got {text!r}")
    return number
