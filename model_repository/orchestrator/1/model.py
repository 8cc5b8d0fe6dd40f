"""Triton adapter for omni_triton.server.orchestrator.Orchestrator (BLS: thinker -> talker -> code2wav)."""

import triton_python_backend_utils as pb_utils

from omni_triton.pipeline.code2wav_stream import ChunkPolicy
from omni_triton.server.metrics import StageMetrics
from omni_triton.server.model_args import limit_torch_threads, model_parameters, report_native_crashes
from omni_triton.server.orchestrator import Orchestrator
from omni_triton.server.stage_io import configure_interstage_memory


class TritonPythonModel:
    def initialize(self, args):
        report_native_crashes()
        params = model_parameters(args)
        limit_torch_threads(int(params["torch_threads"]))
        configure_interstage_memory(params["interstage_memory"])
        policy = ChunkPolicy.from_setting(int(params["first_chunk_frames"]), int(params["next_chunk_frames"]),
                                          params["left_context_frames"])
        self.orchestrator = Orchestrator(pb_utils, params["checkpoint_dir"], params["device"], policy,
                                         max_inflight=int(params["max_inflight_requests"]))
        self.metrics = StageMetrics(pb_utils, "orchestrator", self.orchestrator.snapshot)

    def execute(self, requests):
        for request in requests:
            self.orchestrator.submit(request)
        return None

    def finalize(self):
        self.orchestrator.shutdown()
        self.metrics.stop()
