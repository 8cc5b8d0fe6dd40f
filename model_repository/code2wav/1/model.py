"""Triton adapter for the Code2Wav vocoder: one batched decode for all queued chunks, answered from a thread of its
own once the GPU has decoded them (decoupled: one final response per request; ``deferred_sends``), so the next
batch is decoded while this one's audio goes out.

Two kinds of chunk, batched separately: left-context chunks (CODES + LEFT_CONTEXT: stateless, context cut off)
and stream chunks (CODES + STREAM_ID, STREAM_START on the first: new frames only, the stream's vocoder state kept
here on the stage's device). STREAM_END (with or without CODES) frees the stream's state after the chunk.
"""

import json
import time

import numpy as np
import torch
import triton_python_backend_utils as pb_utils

from omni_triton.engine.handoff import InputStream, ready_event
from omni_triton.load_timeline import LoadTimeline
from omni_triton.models.code2wav.vocoder import exact_left_context_frames
from omni_triton.models.code2wav.runtime import Code2WavRuntime
from omni_triton.pipeline.code2wav.stream_states import Code2WavStreamStates
from omni_triton.pipeline.code2wav.chunking import StreamDecoder
from omni_triton.pipeline.code2wav.warmup import capture_count, stage_graph_settings, warm_up_vocoder
from omni_triton.stages.callers import Callers, GuardedSender, caller_of
from omni_triton.stages.code2wav_call_log import Code2WavCallLog
from omni_triton.stages.code2wav_requests import Code2WavRequests
from omni_triton.stages.decode_pacing import DecodePacing
from omni_triton.stages.deferred_sends import DeferredSends, PendingResponse
from omni_triton.stages.metrics import HostHopCounter
from omni_triton.stages.model_args import (chunk_policy, launch_settings, prepare_stage_process, load_options,
                                           replica_labels, report_native_crashes, stage_device)
from omni_triton.stages.stage_io import configure_interstage_memory, from_torch, request_self, stage_loading
from omni_triton.stage_profile import start_watching
from omni_triton.warmup_progress import PROGRESS_MARK

# launch names (omni-triton serve --code2wav-runtime) -> Code2WavRuntime kinds, and the engine file's argument
RUNTIMES = {"torch": ("torch", None), "onnx": ("onnxruntime", "onnx_path"), "trt": ("tensorrt", "plan_path"),
            "auto": ("auto", None)}


class TritonPythonModel:
    def initialize(self, args):
        timeline = LoadTimeline("code2wav")
        report_native_crashes()
        start_watching("code2wav")  # OMNI_TRITON_PROFILE_DIR: torch.profiler windows on request
        settings = launch_settings(args)
        prepare_stage_process(settings, "code2wav")
        configure_interstage_memory(settings.interstage_memory)
        self.device = stage_device(settings, args)
        kind, engine_argument = RUNTIMES[settings.code2wav_runtime]
        engine_path = settings.code2wav_engine_path
        if kind == "auto" and engine_path:  # the engine file's kind says which runtime it is for
            engine_argument = "plan_path" if engine_path.suffix == ".plan" else "onnx_path"
        engine = {engine_argument: str(engine_path or "")} if engine_argument else {}
        # torch on a GPU: short calls replay CUDA graphs, batches padded up to buckets of this stage's max batch;
        # the graphs of the decode this stage serves (stream chunks with --left-context-frames stateful, else
        # the one pass) are captured here, before the first request: the first chunk's, with warm start every
        # short call's (stream chunks: frame buckets); the other decode's on first use (direct callers only)
        max_batch = int(json.loads(args["model_config"])["max_batch_size"])
        warmup = settings.resolved_warmup
        policy = chunk_policy(settings)
        graphs = stage_graph_settings(policy, max_batch, warmup)
        start = time.monotonic()
        with stage_loading("code2wav", freeze_collector=settings.stage_gc_freeze):
            self.vocoder = Code2WavRuntime.create(kind, str(settings.checkpoint_dir), device=self.device,
                                                  dtype=getattr(torch, settings.resolved_dtype), **engine,
                                                  **load_options(settings), cuda_graphs=settings.cuda_graphs,
                                                  cudnn_autotune=settings.code2wav_cudnn_autotune,
                                                  dilated_phases=settings.code2wav_dilated_phases,
                                                  triton_snake=settings.code2wav_triton_snake, **graphs)
            if getattr(self.vocoder, "graphs", None) is not None:  # torch on a GPU with --cuda-graphs on
                print(f"code2wav: {PROGRESS_MARK}: {capture_count(graphs)} CUDA graphs captured at start (one-pass "
                      f"{graphs['graph_settings'].captures_at_start}, stream chunks "
                      f"{graphs['stream_graph_settings'].captures_at_start}), with the weights' load: "
                      f"{time.monotonic() - start:.1f} s", flush=True)
            if warmup and not policy.stateful:  # stateful short calls: their graphs are captured at start
                warm_up_vocoder(self.vocoder, policy.resolved(exact_left_context_frames(self.vocoder.config)),
                                max_batch)
        self.decoder = StreamDecoder(self._decode, self.vocoder.samples_per_frame, self.vocoder.trim_samples)
        # None: a runtime without streaming state (TensorRT, a one-pass ONNX file); stream chunks then fail
        self.streams = (Code2WavStreamStates(self.vocoder.decode_stream, self.vocoder.state_specs(),
                                             self.vocoder.streaming_samples, self.device, initial_slots=2 * max_batch)
                        if self.vocoder.streams else None)
        stateful = policy.stateful
        if self.streams is None and stateful:
            raise ValueError(f"--left-context-frames stateful needs a code2wav runtime that streams with state "
                             f"(torch, or onnx with an export_code2wav_onnx --stateful file), not {self.vocoder.kind}")
        if self.vocoder.kind == "onnxruntime" and self.vocoder.streams and not stateful:
            raise ValueError("this ONNX file is a --stateful export: serve it with --left-context-frames stateful")
        # A MetricFamily must outlive its metrics: keep both.
        self.metric_families = [
            pb_utils.MetricFamily("omni_code2wav_batch_chunks", "chunks decoded together in the last vocoder call",
                                  pb_utils.MetricFamily.GAUGE),
            pb_utils.MetricFamily("omni_code2wav_decoded_frames_total",
                                  "codec frames decoded (left context included)", pb_utils.MetricFamily.COUNTER),
            pb_utils.MetricFamily("omni_code2wav_streams", "audio streams whose vocoder state this stage holds",
                                  pb_utils.MetricFamily.GAUGE)]
        labels = replica_labels(args)
        self.batch_chunks, self.decoded_frames = (family.Metric(labels) for family in self.metric_families[:2])
        self.open_streams = self.metric_families[2].Metric({"stage": "code2wav", **labels})
        self.host_hops = HostHopCounter(pb_utils, "code2wav", on_gpu=self.device.type == "cuda", labels=labels)
        self.requests = Code2WavRequests(pb_utils, self.vocoder.config, self.host_hops,
                                         None if self.streams is not None else self.vocoder.kind,
                                         InputStream(self.device))
        self.sends = DeferredSends(pb_utils, self.device)
        self.pacing = DecodePacing(settings.code2wav_overlap and self.device.type == "cuda")
        self.model_name = args["model_name"]
        self.callers = Callers("code2wav", self._end_orphan_stream)  # streams whose orchestrator died: closed
        self.call_log = Code2WavCallLog(self.device)  # a trace record per call while tracing is on
        timeline.mark("vocoder, CUDA graphs, stream states")
        timeline.report()

    @torch.inference_mode()
    def _decode(self, codes: torch.Tensor) -> torch.Tensor:
        return self.vocoder.decode(codes.to(self.device)).float()  # stays on the stage's device

    def execute(self, requests):
        responses = [None] * len(requests)  # per request: a maker of its response (called on the sending thread)
        jobs, owners = [], []  # one job per batch row; owners[i]: index of the request it came from
        chunks, chunk_owners, ending = [], [], []  # stream chunks; streams to free after this call
        call = self.call_log.begin(requests)  # None while tracing is off
        if self.streams is not None:
            self.streams.evict_idle()
        keys = [""] * len(requests)  # per request: the stream it holds state for ("": none)
        for index, request in enumerate(requests):
            caller = caller_of(request)
            try:
                parsed = self.requests.parse(request)
            except ValueError as error:
                responses[index] = _invalid(error)
                continue
            if isinstance(parsed, list):  # left-context chunk jobs
                jobs.extend(parsed)
                owners.extend([index] * len(parsed))
                continue
            keys[index] = parsed.stream_id
            if parsed.chunk is not None and parsed.chunk.first:
                self.callers.hold(parsed.stream_id, caller)
            if parsed.end:
                ending.append(parsed.stream_id)
                self.callers.release(parsed.stream_id)
            if parsed.chunk is None:  # STREAM_END alone
                responses[index] = _no_audio
            else:
                chunks.append(parsed.chunk)
                chunk_owners.append(index)
        try:
            with self.call_log.decoding(call):
                audio = self.decoder.decode(jobs)
                outputs = []  # device tensors the responses export
                for index in sorted(set(owners)):
                    outputs += (rows := [wav for wav, owner in zip(audio, owners) if owner == index])
                    responses[index] = _audio_response(lambda rows=rows: torch.stack(rows))
                for index, samples in zip(chunk_owners, self.streams.decode(chunks) if chunks else []):
                    if isinstance(samples, ValueError):
                        responses[index] = _invalid(samples)
                    else:
                        outputs.append(samples)
                        responses[index] = _audio_response(lambda samples=samples: samples[None])
                for stream_id in ending:
                    self.streams.close(stream_id)
        except Exception as error:  # a failed decode fails its batch, never the stage: every request is answered
            for index in {*owners, *chunk_owners}:
                responses[index] = _failed(error)
            outputs = []
        # (frames decoded, new frames) per chunk
        frames = [(job.num_frames, job.new_frames) for job in jobs] + [(c.codes.shape[1],) * 2 for c in chunks]
        # the gauges first: a client that reads them once its response arrived sees this call's streams
        self.batch_chunks.set(len(frames))
        self.decoded_frames.increment(sum(decoded for decoded, _ in frames))
        self.open_streams.set(self.streams.open_streams if self.streams is not None else 0)
        decoded = ready_event(self.device)
        # senders guarded against a caller that died (callers)
        senders = [GuardedSender(self.callers, key, caller_of(request), request.get_response_sender())
                   for key, request in zip(keys, requests)]
        self.sends.send_after(decoded, outputs, [PendingResponse(sender, make)
                                                 for sender, make in zip(senders, responses)],
                              on_sent=self.call_log.when_sent(call))
        # back to Triton once this batch's decode is done (or, --code2wav-overlap on, the previous batch's), not
        # before: the chunks that arrive meanwhile make the next batch (decode_pacing); the export and send still
        # overlap the next batch (deferred_sends)
        self.pacing.before_return(decoded)
        self.call_log.end(call, frames)
        return None

    def _end_orphan_stream(self, stream_id):
        """Close a stream whose caller died with the STREAM_END its caller would have sent: through Triton, so it
        runs between this stage's calls like any other chunk (a stateless chunk has no stream to close)."""
        if stream_id:
            request_self(pb_utils, self.model_name, [
                pb_utils.Tensor("STREAM_ID", np.array([[stream_id.encode()]], dtype=np.object_)),
                pb_utils.Tensor("STREAM_START", np.array([[False]])),
                pb_utils.Tensor("STREAM_END", np.array([[True]]))])

    def finalize(self):
        self.callers.stop()
        self.pacing.drain()
        self.sends.close()
        self.call_log.close()
        del self.batch_chunks, self.decoded_frames, self.open_streams  # metrics before their families
        self.metric_families.clear()
        self.host_hops.close()


def _invalid(error: ValueError):
    return lambda: pb_utils.InferenceResponse(error=pb_utils.TritonError(str(error), pb_utils.TritonError.INVALID_ARG))


def _failed(error: Exception):
    return lambda: pb_utils.InferenceResponse(error=pb_utils.TritonError(f"code2wav: {type(error).__name__}: {error}"))


def _no_audio():
    return pb_utils.InferenceResponse([pb_utils.Tensor("AUDIO", np.zeros((1, 0), np.float32))])


def _audio_response(audio):
    """A maker of the response holding ``audio()`` (made on the sending thread's stream, after the decode)."""
    return lambda: pb_utils.InferenceResponse([from_torch(pb_utils, "AUDIO", audio())])
