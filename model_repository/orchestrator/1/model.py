"""Triton adapter for omni_triton.server.orchestrator.Orchestrator (BLS: thinker -> talker -> code2wav)."""

import triton_python_backend_utils as pb_utils

from omni_triton.server.admission import RealtimeCapacity
from omni_triton.server.metrics import StageMetrics
from omni_triton.server.model_args import limit_torch_threads, model_parameters, report_native_crashes
from omni_triton.server.orchestrator import Orchestrator
from omni_triton.server.placement import parse_instances
from omni_triton.server.repository import admission_capacity_setting
from omni_triton.server.stage_io import chunk_policy, configure_interstage_memory, stage_device
from omni_triton.stage_profile import start_watching


class TritonPythonModel:
    def initialize(self, args):
        report_native_crashes()
        start_watching("orchestrator")  # OMNI_TRITON_PROFILE_DIR: torch.profiler windows on request
        params = model_parameters(args)
        limit_torch_threads(int(params["torch_threads"]))
        configure_interstage_memory(params["interstage_memory"])
        capacity = admission_capacity_setting(params["admission_capacity"])
        self.orchestrator = Orchestrator(
            pb_utils, params["checkpoint_dir"], stage_device(params, args), chunk_policy(params),
            max_inflight=int(params["max_inflight_requests"]), chunk_pacing=params["chunk_pacing"],
            admission_queue=int(params["admission_queue"]), max_starting=int(params["admission_max_starting"]),
            capacity=None if capacity == "off" else RealtimeCapacity(None if capacity == "auto" else capacity),
            stage_instances=parse_instances(params["stage_instances"]))
        self.metrics = StageMetrics(pb_utils, "orchestrator", self.orchestrator.snapshot)

    def execute(self, requests):
        for request in requests:
            self.orchestrator.submit(request)
        return None

    def finalize(self):
        self.orchestrator.shutdown()
        self.metrics.stop()
