"""Triton adapter for omni_triton.pipeline.thinker_service.ThinkerService (decoupled streaming)."""

import itertools

import triton_python_backend_utils as pb_utils

from omni_triton.pipeline.stage_requests import thinker_request
from omni_triton.server.metrics import StageMetrics, engine_snapshot
from omni_triton.server.model_args import limit_torch_threads, model_parameters, report_native_crashes
from omni_triton.server.stage_io import (answer_abort, configure_interstage_memory, engine_config, input_arrays,
                                         load_options, quantization, send_output, stage_device,
                                         stage_loading, thinker_output_tensors)
from omni_triton.pipeline.thinker_service import ThinkerService
from omni_triton.stage_profile import start_watching

REQUEST_INPUTS = ("INPUT_IDS", "AUDIO_FEATURES", "MAX_TOKENS", "MIN_TOKENS", "TEMPERATURE", "TOP_P", "TOP_K",
                  "REPETITION_PENALTY", "SEED", "IGNORE_EOS")


class TritonPythonModel:
    def initialize(self, args):
        report_native_crashes()
        start_watching("thinker")  # OMNI_TRITON_PROFILE_DIR: torch.profiler windows on request
        params = model_parameters(args)
        limit_torch_threads(int(params["torch_threads"]))
        configure_interstage_memory(params["interstage_memory"])
        config, dtype = engine_config(params, stage_device(params, args))
        with stage_loading("thinker"):
            self.service = ThinkerService(params["checkpoint_dir"], config, dtype, **load_options(params),
                                          quantization=quantization(params))
        self.metrics = StageMetrics(pb_utils, "thinker", lambda: engine_snapshot(self.service.loop.stats()))
        self._anonymous = itertools.count()

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
        try:
            self.service.submit(request_id, thinker,
                                lambda out: send_output(pb_utils, sender, out, thinker_output_tensors))
        except Exception as error:  # a caller blocked on this request must always get its final response
            sender.send(pb_utils.InferenceResponse(
                error=pb_utils.TritonError(f"thinker request {request_id}: {type(error).__name__}: {error}")),
                flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def finalize(self):
        self.service.shutdown()
        self.metrics.stop()
