"""Triton adapter for the Code2Wav vocoder: one batched decode for all queued chunks, left context cut off."""

import json

import torch
import triton_python_backend_utils as pb_utils

from omni_triton.models.code2wav import check_code_range, code_embedding_rows, exact_left_context_frames
from omni_triton.models.code2wav_graphs import GraphSettings
from omni_triton.models.code2wav_runtime import Code2WavRuntime
from omni_triton.pipeline.code2wav_stream import ChunkJob, StreamDecoder
from omni_triton.pipeline.code2wav_warmup import warm_up_vocoder
from omni_triton.server.metrics import HostHopCounter
from omni_triton.server.model_args import (limit_torch_threads, model_parameters, replica_labels,
                                          report_native_crashes)
from omni_triton.server.stage_io import (chunk_policy, configure_interstage_memory, from_torch, host_array,
                                         load_options, stage_device, stage_loading, to_torch)

# launch names (omni-triton serve --code2wav-runtime) -> Code2WavRuntime kinds, and the engine file's argument
RUNTIMES = {"torch": ("torch", None), "onnx": ("onnxruntime", "onnx_path"), "trt": ("tensorrt", "plan_path"),
            "auto": ("auto", None)}


class TritonPythonModel:
    def initialize(self, args):
        report_native_crashes()
        params = model_parameters(args)
        limit_torch_threads(int(params["torch_threads"]))
        configure_interstage_memory(params["interstage_memory"])
        self.device = stage_device(params, args)
        kind, engine_argument = RUNTIMES[params["runtime"]]
        if kind == "auto" and params["engine_path"]:  # the engine file's kind says which runtime it is for
            engine_argument = "plan_path" if params["engine_path"].endswith(".plan") else "onnx_path"
        engine = {engine_argument: params["engine_path"]} if engine_argument else {}
        # torch on a GPU: short calls replay CUDA graphs, batches padded up to buckets of this stage's max batch;
        # the first-chunk shapes (warm start: every short call's) are captured here, before the first request
        max_batch = int(json.loads(args["model_config"])["max_batch_size"])
        warmup = params["warmup"] == "on"
        graphs = dict(cuda_graphs=params["cuda_graphs"] == "on",
                      graph_settings=GraphSettings.for_stage(max_batch, int(params["first_chunk_frames"]),
                                                             every_short_call=warmup))
        with stage_loading("code2wav"):
            self.vocoder = Code2WavRuntime.create(kind, params["checkpoint_dir"], device=self.device,
                                                  dtype=getattr(torch, params["dtype"]), **engine,
                                                  **load_options(params), **graphs)
            if warmup:
                warm_up_vocoder(self.vocoder, chunk_policy(params).resolved(
                    exact_left_context_frames(self.vocoder.config)), max_batch)
        self.embedding_rows = code_embedding_rows(self.vocoder.config)
        self.decoder = StreamDecoder(self._decode, self.vocoder.samples_per_frame, self.vocoder.trim_samples)
        # A MetricFamily must outlive its metrics: keep both.
        self.metric_families = [
            pb_utils.MetricFamily("omni_code2wav_batch_chunks", "chunks decoded together in the last vocoder call",
                                  pb_utils.MetricFamily.GAUGE),
            pb_utils.MetricFamily("omni_code2wav_decoded_frames_total",
                                  "codec frames decoded (left context included)", pb_utils.MetricFamily.COUNTER)]
        labels = replica_labels(args)
        self.batch_chunks, self.decoded_frames = (family.Metric(labels) for family in self.metric_families)
        self.host_hops = HostHopCounter(pb_utils, "code2wav", on_gpu=self.device.type == "cuda", labels=labels)

    @torch.inference_mode()
    def _decode(self, codes: torch.Tensor) -> torch.Tensor:
        return self.vocoder.decode(codes.to(self.device)).float()  # stays on the stage's device

    def execute(self, requests):
        responses = [None] * len(requests)
        jobs, owners = [], []  # one job per batch row; owners[i]: index of the request it came from
        for index, request in enumerate(requests):
            try:
                rows = self._jobs(request)
            except ValueError as error:
                responses[index] = pb_utils.InferenceResponse(
                    error=pb_utils.TritonError(str(error), pb_utils.TritonError.INVALID_ARG))
                continue
            jobs.extend(rows)
            owners.extend([index] * len(rows))
        audio = self.decoder.decode(jobs)
        self.batch_chunks.set(len(jobs))
        self.decoded_frames.increment(sum(job.num_frames for job in jobs))
        for index in sorted(set(owners)):
            rows = [wav for wav, owner in zip(audio, owners) if owner == index]
            responses[index] = pb_utils.InferenceResponse([from_torch(pb_utils, "AUDIO", torch.stack(rows))])
        return responses

    def finalize(self):
        del self.batch_chunks, self.decoded_frames  # metrics before their families
        self.metric_families.clear()
        self.host_hops.close()

    def _jobs(self, request) -> list[ChunkJob]:
        """CODES [b, G, N] + LEFT_CONTEXT [b, 1] -> b chunk jobs (raises ValueError naming the bad input)."""
        codes_tensor = pb_utils.get_input_tensor_by_name(request, "CODES")
        self.host_hops.check(codes_tensor)
        codes = to_torch(codes_tensor)  # on the device the talker produced it on
        left_context = host_array(pb_utils.get_input_tensor_by_name(request, "LEFT_CONTEXT")).reshape(-1)
        num_frames = codes.shape[-1]
        if num_frames < 1:
            raise ValueError("CODES must hold at least one frame")
        check_code_range(codes, self.vocoder.config.codebook_size, self.embedding_rows)
        jobs = []
        for row, context in enumerate(left_context.tolist()):
            if not 0 <= context < num_frames:
                raise ValueError(f"LEFT_CONTEXT must be in [0, {num_frames - 1}] for {num_frames} frames, "
                                 f"got {context}")
            jobs.append(ChunkJob.after_context(codes[row], context))
        return jobs
