"""What every model_repository/*/1/model.py reads at initialize: its launch settings, and the stage objects built
from them (device, engine config, chunking, weights), so that each setting is read in one place."""

from __future__ import annotations

import atexit
import faulthandler
import json
import sys
from typing import Any

import torch

from omni_triton.engine import EngineConfig
from omni_triton.engine.output_batching import OutputBatching
from omni_triton.pipeline.code2wav.chunking import ChunkPolicy
from omni_triton.shared.placement import OrchestratorSlot, model_stage, orchestrator_instance
from omni_triton.shared.settings import LaunchConfig
from omni_triton.shared.stub_processes import STACK_DUMP_SIGNAL


def launch_settings(args: dict) -> LaunchConfig:
    """The launch settings the launcher wrote into this model's config.pbtxt (its ``settings`` parameter), as the
    same typed object (``LaunchConfig.from_json``)."""
    parameters = json.loads(args["model_config"]).get("parameters", {})
    if "settings" not in parameters:
        raise ValueError(f"model {args.get('model_name')!r}: its config.pbtxt has no 'settings' parameter (render "
                         "the repository with omni-triton serve, or omni_triton.launch.repository.render_repository)")
    return LaunchConfig.from_json(parameters["settings"]["string_value"])


def stage_device(settings: LaunchConfig, args: dict) -> torch.device:
    """This model instance's device: the GPU Triton placed it on (``model_instance_device_id``, from the
    instance_group's ``gpus``), made current for the calling thread (the stub's, which runs initialize and
    execute), so that what uses the current device (kernel launches, syncs, memory queries) uses this one and
    not cuda:0; or the CPU."""
    if settings.device == "cpu":
        return torch.device("cpu")
    device = torch.device("cuda", int(args["model_instance_device_id"]))
    torch.cuda.set_device(device)
    return device


def engine_config(settings: LaunchConfig, stage: str, device: torch.device) -> tuple[EngineConfig, torch.dtype]:
    """The AR engine's config and dtype of ``stage`` (thinker | talker: each has its own KV budget)."""
    dtype = getattr(torch, settings.resolved_dtype)
    tokens = settings.resolved_talker_kv_cache_tokens if stage == "talker" else settings.kv_cache_tokens
    block_size = settings.kv_block_size
    config = EngineConfig(block_size=block_size, num_blocks=max(1, tokens // block_size),
                          max_num_batched_tokens=settings.max_batched_tokens,
                          max_num_seqs=settings.max_inflight_requests, device=str(device), kv_dtype=dtype,
                          fast_path=settings.fast_path, cuda_graphs=settings.cuda_graphs,
                          prefill_graph_tokens=None if settings.prefill_graphs else 0,
                          linear_launch=settings.linear_launch, dependent_launch=settings.dependent_launch,
                          overlap_steps=settings.overlap_steps, prefix_caching=settings.prefix_caching,
                          warmup=settings.resolved_warmup, output_batching=output_batching(settings, stage))
    return config, dtype


# A stream's outputs, after its first, go at this many steps at a time (within --stage-output-hold-ms): the talker
# makes a frame a step, and a response of 8 frames is 640 ms of audio, more than the chunk after the first
# (--first-chunk-frames, doubling) needs; the thinker's text runs ahead of the talker, which takes a token a frame,
# but its first tokens go one by one so the talker's first frames never wait for a batch.
TALKER_FRAMES_PER_OUTPUT = 8
# (after those, --thinker-tokens-per-output a response)
THINKER_EAGER_TOKENS = 8


def output_batching(settings: LaunchConfig, stage: str) -> OutputBatching:
    """When ``stage``'s engine hands a stream's outputs to its response sender (engine/output_batching.py)."""
    hold_ms = settings.stage_output_hold_ms
    if stage == "thinker" and settings.thinker_output_hold_ms is not None:
        hold_ms = settings.thinker_output_hold_ms
    if hold_ms == 0:
        return OutputBatching()
    if stage == "talker":  # its first response carries the first audio chunk's frames
        return OutputBatching(first_tokens=settings.first_chunk_frames, min_tokens=TALKER_FRAMES_PER_OUTPUT,
                              max_hold_s=hold_ms / 1000)
    return OutputBatching(first_tokens=1, eager_tokens=THINKER_EAGER_TOKENS,
                          min_tokens=settings.thinker_tokens_per_output, max_hold_s=hold_ms / 1000)


def chunk_policy(settings: LaunchConfig) -> ChunkPolicy:
    """The audio chunking the settings name (``--left-context-frames``: stateful, exact -- resolved later against
    the vocoder -- or a frame count)."""
    return ChunkPolicy.from_setting(settings.first_chunk_frames, settings.next_chunk_frames,
                                    settings.resolved_left_context_frames)


def load_options(settings: LaunchConfig) -> dict[str, Any]:
    """How a stage gets its weights: ``load_format`` (safetensors | dummy) and the dummy weights' ``seed``."""
    return {"load_format": settings.load_format, "seed": settings.dummy_seed}


def quantization(settings: LaunchConfig) -> str | None:
    """The thinker's and talker's weights quantized at load (``--quantization``): "fp8", or None (the
    checkpoint's own). Each stage's loader decides what it serves in FP8 (``models.quantization.served_in_fp8``:
    the talker keeps the model dtype)."""
    return None if settings.quantization == "none" else settings.quantization


def replica_labels(args: dict) -> dict[str, str]:
    """Metric labels that tell this instance from its replicas: its pipeline under ``pipeline`` (``serve
    --pipelines``: a model named thinker_p1 is pipeline 1's thinker), and its instance name (talker_0_1) under
    ``model_instance`` when the model has several instances (``serve --instances``); none for the one instance
    of one pipeline. Without them the replicas would write one series, each overwriting the others' gauges.
    (Not ``instance``: Prometheus sets that label to the scraped target.)"""
    labels = {}
    model = args.get("model_name", "")
    if model != model_stage(model)[0]:
        labels["pipeline"] = str(model_stage(model)[1])
    groups = json.loads(args["model_config"]).get("instance_group", [])
    instances = sum(int(group.get("count", 1)) * max(1, len(group.get("gpus", []))) for group in groups)
    if instances > 1:
        labels["model_instance"] = args["model_instance_name"]
    return labels


def orchestrator_slot(settings: LaunchConfig, args: dict) -> tuple[int, OrchestratorSlot, dict[str, str]]:
    """The pipeline this orchestrator instance serves (``serve --pipelines``: one group of instances each, told
    apart by name, ``placement.orchestrator_instance``), which of the server's instances it is, and the labels of
    its metrics: ``pipeline`` with several, ``model_instance`` with several instances per pipeline (as
    ``replica_labels``), so that no two instances write one series; none with one instance."""
    placement = settings.placement
    pipeline, index = orchestrator_instance(args["model_instance_name"], placement.pipelines)
    labels = {"pipeline": str(pipeline)} if placement.pipelines > 1 else {}
    if placement.count("orchestrator") > 1:
        labels["model_instance"] = args["model_instance_name"]
    slot = OrchestratorSlot(index, placement.count("orchestrator"), placement.orchestrator_instances)
    return pipeline, slot, labels


def prepare_stage_process(settings: LaunchConfig, stage: str) -> None:
    """What every stage's stub process sets before its model loads: its torch threads, its GIL switch interval."""
    limit_torch_threads(settings.threads_of(stage))
    if settings.gil_switch_interval_ms is not None:
        sys.setswitchinterval(settings.gil_switch_interval_ms / 1000)


def limit_torch_threads(threads: int) -> None:
    """Each stage is its own stub process: without a cap, every one of them spawns a thread per core."""
    torch.set_num_threads(max(1, threads))
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set: only allowed once per process, before any parallel work
        pass


def report_native_crashes() -> None:
    """A stub that dies of a signal (a native crash) prints every thread's Python stack to the server's log
    first: Triton itself only notices later that the stub is gone, and says nothing about why. Not while the
    interpreter shuts down: the stubs of this Triton build crash in their final garbage collection after
    every model is unloaded, which is harmless and would fill the log with alarms at every shutdown. Asked with
    ``STACK_DUMP_SIGNAL`` (a stop whose unload outlives its timeout: ``launch.tritonserver``), the stub writes the
    same stacks and goes on."""
    faulthandler.enable(all_threads=True)
    faulthandler.register(STACK_DUMP_SIGNAL, all_threads=True)
    atexit.register(faulthandler.disable)
