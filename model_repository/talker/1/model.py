"""Triton adapter for omni_triton.pipeline.talker_service.TalkerService (sequence-batched, decoupled)."""

import torch
import triton_python_backend_utils as pb_utils

from omni_triton import trace
from omni_triton.engine.handoff import InputStream
from omni_triton.pipeline.stage_requests import talker_request
from omni_triton.pipeline.talker_service import TalkerService
from omni_triton.stages.callers import Callers, GuardedSender, caller_of
from omni_triton.stages.deferred_sends import DeferredSends, PendingResponse
from omni_triton.stages.metrics import HostHopCounter, StageMetrics, engine_snapshot
from omni_triton.stages.model_args import (engine_config, launch_settings, prepare_stage_process, load_options,
                                           quantization, replica_labels, report_native_crashes, stage_device)
from omni_triton.stages.stage_io import (OrphanSequences, answer_abort, configure_interstage_memory, host_array,
                                         input_arrays, request_inputs, send_output, stage_loading,
                                         talker_output_tensors, thinker_output_from_request)
from omni_triton.stage_profile import start_watching

START_INPUTS = ("SPEAKER_ID", "TEMPERATURE", "TALKER_REPETITION_PENALTY", "SEED", "IGNORE_EOS", "MAX_AUDIO_FRAMES",
                "MIN_AUDIO_FRAMES")
FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


class TritonPythonModel:
    def initialize(self, args):
        report_native_crashes()
        start_watching("talker")  # OMNI_TRITON_PROFILE_DIR: torch.profiler windows on request
        settings = launch_settings(args)
        prepare_stage_process(settings, "talker")
        configure_interstage_memory(settings.interstage_memory)
        device = stage_device(settings, args)
        config, dtype = engine_config(settings, "talker", device)
        self.inputs = InputStream(device)  # request inputs copied without waiting for the talker's steps
        with stage_loading("talker", freeze_collector=settings.stage_gc_freeze):
            self.service = TalkerService(settings.checkpoint_dir, config, dtype, **load_options(settings),
                                         quantization=quantization(settings))
        labels = replica_labels(args)
        self.host_hops = HostHopCounter(pb_utils, "talker", on_gpu=settings.device != "cpu", labels=labels)
        self.metrics = StageMetrics(pb_utils, "talker", lambda: engine_snapshot(
            self.service.loop.stats(), extra_active=self.service.num_pending), labels=labels)
        # a sequence whose orchestrator died is ended like one it aborted: through the sequence batcher, which
        # frees the sequence's slot there and routes the END to this instance
        self.orphans = OrphanSequences(pb_utils, args["model_name"])
        self.callers = Callers("talker", self.orphans.end)
        # a thinker chunk's final response (a flag, no tensors: no stream needed) sent from a thread of its own,
        # so that execute takes the next batch meanwhile
        self.acks = DeferredSends(pb_utils, torch.device("cpu"))

    def execute(self, requests):
        for request in requests:
            self._handle(request)
        return None

    def _handle(self, request):
        sender = request.get_response_sender()
        request_id = request.request_id() or f"sequence-{request.correlation_id()}"
        if answer_abort(pb_utils, request, sender, self.service.abort, request_id):
            return
        tensors = request_inputs(request)  # one pass over the inputs, not one per name
        is_start = bool(host_array(tensors.get("START")).reshape(-1)[0])
        if is_start:
            trace.event(request_id, "talker.received")  # the BLS hop's end: its parse and prefill come next
        caller = caller_of(request)

        def send(out):
            self.callers.send(request_id, caller, lambda: send_output(pb_utils, sender, out, talker_output_tensors))
            if out.finished:
                self.callers.release(request_id)
                self.orphans.forget(request_id)

        try:
            self.host_hops.check(tensors.get("EMBEDS"), tensors.get("HIDDEN"))
            chunk = thinker_output_from_request(pb_utils, request, self.inputs, tensors)
            if is_start:
                talker = talker_request({name: value.reshape(-1) for name, value in
                                         input_arrays(pb_utils, request, START_INPUTS).items()})
                # BLS exec() returns only with a first response, and the caller still has thinker chunks
                # to append: acknowledge at once with an empty frame batch so it never waits on the talker.
                sender.send(pb_utils.InferenceResponse(talker_output_tensors(pb_utils, self.service.no_frames())))
                self.orphans.started(request_id, request.correlation_id())
                self.callers.hold(request_id, caller)
                self.service.start(request_id, talker, chunk, send)
            else:
                self.service.append(request_id, chunk)
                self.acks.send_after(None, [], [PendingResponse(GuardedSender(self.callers, request_id, caller,
                                                                              sender))])
        except (AttributeError, KeyError, ValueError) as error:
            sender.send(pb_utils.InferenceResponse(
                error=pb_utils.TritonError(f"talker request {request_id}: {error}", pb_utils.TritonError.INVALID_ARG)),
                flags=FINAL)
        except Exception as error:  # a caller blocked on this request must always get its final response
            sender.send(pb_utils.InferenceResponse(
                error=pb_utils.TritonError(f"talker request {request_id}: {type(error).__name__}: {error}")),
                flags=FINAL)

    def finalize(self):
        self.acks.close()
        self.callers.stop()
        self.service.shutdown()
        self.metrics.stop()
        self.host_hops.close()
