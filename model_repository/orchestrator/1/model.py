"""Triton adapter for omni_triton.stages.orchestrator.Orchestrator (BLS: thinker -> talker -> code2wav), one
instance or more (--instances orchestrator) per pipeline (serve --pipelines)."""

import os

import triton_python_backend_utils as pb_utils

from omni_triton.shared.admission_board import BoardWriter, board_path
from omni_triton.shared.cancel_registry import CancelRegistry, registry_dir
from omni_triton.shared.placement import GPU_STAGES
from omni_triton.shared.settings import admission_capacity_setting
from omni_triton.stages.admission import RealtimeCapacity
from omni_triton.stages.collector import freeze_loaded_objects
from omni_triton.stages.metrics import StageMetrics
from omni_triton.stages.model_args import (chunk_policy, launch_settings, prepare_stage_process, orchestrator_slot,
                                           report_native_crashes, stage_device)
from omni_triton.stages.orchestrator import Orchestrator, pipeline_route
from omni_triton.stages.running_threads import dump_if_still_alive
from omni_triton.stages.stage_io import configure_interstage_memory
from omni_triton.stage_profile import start_watching


UNLOAD_STACKS_AFTER_S = 6.0


class TritonPythonModel:
    def initialize(self, args):
        report_native_crashes()
        start_watching("orchestrator")  # OMNI_TRITON_PROFILE_DIR: torch.profiler windows on request
        settings = launch_settings(args)
        prepare_stage_process(settings, "orchestrator")
        configure_interstage_memory(settings.interstage_memory)
        capacity = admission_capacity_setting(settings.resolved_admission_capacity)
        device = stage_device(settings, args)
        pipeline, slot, labels = orchestrator_slot(settings, args)
        forced = None if capacity == "auto" else capacity
        self.orchestrator = Orchestrator(
            pb_utils, settings.checkpoint_dir, device, chunk_policy(settings),
            max_inflight=settings.max_inflight_requests, chunk_pacing=settings.chunk_pacing,
            admission_queue=settings.admission_queue, admission_max_wait_s=settings.admission_max_wait,
            admission_max_queue_wait_s=settings.admission_max_queue_wait,
            max_starting=settings.resolved_admission_max_starting,
            capacity=None if capacity == "off" else RealtimeCapacity(forced, share=slot.per_pipeline),
            # the orchestrator watches every stage instance's process of its pipeline (stage_supervisor)
            stage_instances={stage: settings.placement.count(stage) for stage in GPU_STAGES},
            route=pipeline_route(settings.placement, pipeline, device),
            # the other instances: a cancel may reach one that does not hold the request
            shared_cancels=CancelRegistry(registry_dir(os.getppid())) if slot.total > 1 else None,
            metric_labels=labels, slot=slot,
            # preprocess refuses before its work when every instance would (admission_board)
            board=BoardWriter(board_path(os.getppid(), f"{pipeline}.{slot.index}")))
        self.metrics = StageMetrics(pb_utils, "orchestrator", self.orchestrator.snapshot, labels=labels)
        if settings.stage_gc_freeze:  # every stream's hops go through this process: no full walk of its imports
            freeze_loaded_objects("orchestrator")

    def execute(self, requests):
        for request in requests:
            self.orchestrator.submit(request)
        return None

    def finalize(self):
        # an unload past this says where it waits (tritonserver's exit timeout is 10 s by default)
        dump_if_still_alive(UNLOAD_STACKS_AFTER_S)
        self.orchestrator.shutdown()
        self.metrics.stop()
