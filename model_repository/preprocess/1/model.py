"""Triton adapter for omni_triton.pipeline.preprocess.Preprocessor (validation, chat template, features)."""

import os

import numpy as np
import triton_python_backend_utils as pb_utils

from omni_triton.error_tags import triton_error
from omni_triton.shared.admission_board import (DIRECT_CALL, LET_THROUGH, EarlyRefusal, board_path, instance_names,
                                                on_its_way)
from omni_triton.pipeline.preprocess import Preprocessor
from omni_triton.pipeline.request_params import InvalidRequest, RequestLimits
from omni_triton.stages.model_args import launch_settings, prepare_stage_process, report_native_crashes

CLIENT_INPUTS = ("TEXT", "AUDIO_IN", "MAX_TOKENS", "MIN_TOKENS", "SPEAKER", "TEMPERATURE", "TOP_P", "TOP_K",
                 "REPETITION_PENALTY", "TALKER_REPETITION_PENALTY", "SEED", "RETURN_AUDIO", "IGNORE_EOS",
                 "MAX_AUDIO_FRAMES", "MIN_AUDIO_FRAMES", "SEQUENTIAL", "HISTORY")


class TritonPythonModel:
    def initialize(self, args):
        report_native_crashes()
        settings = launch_settings(args)
        prepare_stage_process(settings, "preprocess")
        limits = RequestLimits(
            max_text_chars=settings.max_text_chars, max_audio_seconds=settings.max_audio_seconds,
            max_tokens_cap=settings.max_tokens_cap, default_max_tokens=settings.default_max_tokens,
            max_audio_frames_cap=settings.max_audio_frames_cap)
        # what each engine's cache holds: whole blocks, at least one (as the engines size it)
        block = settings.kv_block_size
        thinker_tokens, talker_tokens = (max(1, tokens // block) * block for tokens in
                                         (settings.kv_cache_tokens, settings.resolved_talker_kv_cache_tokens))
        self.preprocessor = Preprocessor(settings.checkpoint_dir, limits, thinker_tokens, talker_tokens)
        self.rejected = pb_utils.MetricFamily(
            "omni_preprocess_rejected_requests_total", "requests refused with INVALID_ARG, by input",
            pb_utils.MetricFamily.COUNTER)
        self.rejected_by_field = {}
        # the orchestrator instances' admission (admission_board): a request they have no room for, those already
        # let through counted, is refused here, before any work, and without waiting for the orchestrator's thread
        self.early_refusal = EarlyRefusal([board_path(os.getppid(), name) for name in instance_names(
            settings.placement.pipelines, settings.placement.count("orchestrator"))])
        self.busy = pb_utils.MetricFamily(
            "omni_preprocess_refused_busy_requests_total",
            "requests refused with UNAVAILABLE before preprocessing: the orchestrator instances had no room for them",
            pb_utils.MetricFamily.COUNTER)
        self.refused_busy = self.busy.Metric({"stage": "preprocess"})

    def execute(self, requests):
        return [self._respond(request) for request in requests]

    def finalize(self):
        self.rejected_by_field.clear()  # metrics before their family
        del self.rejected, self.refused_busy, self.busy

    def _respond(self, request):
        # only a request of the omni ensemble goes on to an orchestrator: a direct call is neither refused for the
        # orchestrators' room nor counted against it (it would never arrive there)
        ensemble = on_its_way(request.requested_output_names())
        refusal = self.early_refusal.refusal() if ensemble else None
        if refusal is not None:
            self.refused_busy.increment(1)
            return pb_utils.InferenceResponse(error=triton_error(pb_utils, "UNAVAILABLE", refusal))
        inputs = {}
        for name in CLIENT_INPUTS:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            inputs[name] = None if tensor is None else tensor.as_numpy()
        try:
            outputs = self.preprocessor(inputs)
        except InvalidRequest as error:
            if error.field not in self.rejected_by_field:
                self.rejected_by_field[error.field] = self.rejected.Metric({"input": error.field})
            self.rejected_by_field[error.field].increment(1)
            return pb_utils.InferenceResponse(
                error=triton_error(pb_utils, "INVALID_ARG", str(error)))
        outputs[LET_THROUGH] = np.array([self.early_refusal.let_through() if ensemble else 0], dtype=np.int64)
        outputs[DIRECT_CALL] = np.array([not ensemble])
        return pb_utils.InferenceResponse([pb_utils.Tensor(name, value) for name, value in outputs.items()])
