"""Triton adapter for omni_triton.pipeline.thinker_service.ThinkerService (decoupled streaming)."""

import itertools

import triton_python_backend_utils as pb_utils

from omni_triton.pipeline.stage_requests import thinker_request
from omni_triton.stages.callers import Callers, caller_of
from omni_triton.stages.metrics import StageMetrics, engine_snapshot
from omni_triton.stages.model_args import (engine_config, launch_settings, prepare_stage_process, load_options,
                                           quantization, replica_labels, report_native_crashes, stage_device)
from omni_triton.stages.stage_io import (answer_abort, configure_interstage_memory, input_arrays, send_output,
                                         stage_loading, thinker_output_tensors)
from omni_triton.pipeline.thinker_service import ThinkerService
from omni_triton.stage_profile import start_watching

REQUEST_INPUTS = ("INPUT_IDS", "AUDIO_FEATURES", "MAX_TOKENS", "MIN_TOKENS", "TEMPERATURE", "TOP_P", "TOP_K",
                  "REPETITION_PENALTY", "SEED", "IGNORE_EOS")


class TritonPythonModel:
    def initialize(self, args):
        report_native_crashes()
        start_watching("thinker")  # OMNI_TRITON_PROFILE_DIR: torch.profiler windows on request
        settings = launch_settings(args)
        prepare_stage_process(settings, "thinker")
        configure_interstage_memory(settings.interstage_memory)
        config, dtype = engine_config(settings, "thinker", stage_device(settings, args))
        with stage_loading("thinker", freeze_collector=settings.stage_gc_freeze):
            self.service = ThinkerService(settings.checkpoint_dir, config, dtype, **load_options(settings),
                                          quantization=quantization(settings))
        self.metrics = StageMetrics(pb_utils, "thinker", lambda: engine_snapshot(self.service.loop.stats()),
                                    labels=replica_labels(args))
        self._anonymous = itertools.count()
        self.callers = Callers("thinker", self.service.abort)  # requests whose orchestrator died: dropped

    def execute(self, requests):
        for request in requests:
            self._handle(request)
        return None

    def _handle(self, request):
        sender = request.get_response_sender()
        request_id = request.request_id() or f"anonymous-{next(self._anonymous)}"
        if answer_abort(pb_utils, request, sender, self.service.abort, request_id):
            return
        try:
            thinker = thinker_request(input_arrays(pb_utils, request, REQUEST_INPUTS), self.service.eos_token_ids)
        except (KeyError, ValueError) as error:
            message = f"missing input {error}" if isinstance(error, KeyError) else str(error)
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(message, pb_utils.TritonError.INVALID_ARG)),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        caller = caller_of(request)

        def send(out):
            self.callers.send(request_id, caller, lambda: send_output(pb_utils, sender, out, thinker_output_tensors))
            if out.finished:
                self.callers.release(request_id)

        self.callers.hold(request_id, caller)
        try:
            self.service.submit(request_id, thinker, send)
        except Exception as error:  # a caller blocked on this request must always get its final response
            self.callers.release(request_id)
            sender.send(pb_utils.InferenceResponse(
                error=pb_utils.TritonError(f"thinker request {request_id}: {type(error).__name__}: {error}")),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self):
        self.callers.stop()
        self.service.shutdown()
        self.metrics.stop()
