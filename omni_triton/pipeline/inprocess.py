"""The whole pipeline in one process, without Triton: the same preprocess, stage services and Session
the server runs, with stages called directly instead of through BLS.

It is the baseline that shows what Triton costs, and the oracle the server's integration tests
compare against.
"""

from __future__ import annotations

import itertools
import queue
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np
import torch
from tokenizers import Tokenizer

from omni_triton.engine import EngineConfig
from omni_triton.models.code2wav.vocoder import exact_left_context_frames
from omni_triton.models.code2wav.runtime import Code2WavRuntime
from omni_triton.pipeline.code2wav.pacing import ChunkPacer
from omni_triton.pipeline.code2wav.stream_states import Code2WavStreamStates, StreamChunk
from omni_triton.pipeline.code2wav.chunking import ChunkJob, ChunkPolicy, Code2WavStream, StreamDecoder
from omni_triton.pipeline.code2wav.warmup import stage_graph_settings, warm_up_vocoder
from omni_triton.pipeline.detokenizer import IncrementalDetokenizer
from omni_triton.pipeline.preprocess import Preprocessor
from omni_triton.pipeline.request_params import RequestLimits
from omni_triton.pipeline.session import Session, SessionParams, ThinkerChunk
from omni_triton.pipeline.stage_requests import talker_request, thinker_request
from omni_triton.pipeline.talker_service import TalkerService
from omni_triton.pipeline.thinker_service import ThinkerOutput, ThinkerService, merge_appends


class StageFailed(RuntimeError):
    pass


class InProcessPipeline:
    def __init__(self, checkpoint_dir: str | Path, *, device: str = "cpu", dtype: torch.dtype = torch.float32,
                 engine_config: EngineConfig | None = None, talker_engine_config: EngineConfig | None = None,
                 policy: ChunkPolicy = ChunkPolicy(), limits: RequestLimits = RequestLimits(),
                 load_format: str = "safetensors", seed: int = 0, chunk_pacing: str = "adaptive",
                 quantization: str | None = None):
        """``talker_engine_config``: default ``engine_config``. ``load_format`` dummy: seeded random weights
        (``seed``) from the checkpoint dir's config.json, as the served stages load them. The vocoder is the
        code2wav stage's torch runtime, with CUDA graphs for its short calls when ``engine_config.cuda_graphs``
        (the same switch the served stages read). ``chunk_pacing``: adaptive (``ChunkPacer``) or ramp, as served.
        ``quantization`` "fp8": the thinker's and talker's weights quantized at load, as served."""
        engine_config = engine_config or EngineConfig(num_blocks=1024, device=device, kv_dtype=dtype)
        talker_engine_config = talker_engine_config or engine_config
        self.device = torch.device(device)
        self.preprocessor = Preprocessor(checkpoint_dir, limits, _cache_tokens(engine_config),
                                         _cache_tokens(talker_engine_config))
        weights = dict(load_format=load_format, seed=seed)
        self.thinker = ThinkerService(checkpoint_dir, engine_config, dtype, **weights, quantization=quantization)
        self.talker = TalkerService(checkpoint_dir, talker_engine_config, dtype, **weights, quantization=quantization)
        # decode_chunk decodes one stream's chunk per call: batch 1 is the only bucket
        self.vocoder = Code2WavRuntime.create(
            "torch", checkpoint_dir, device=self.device, dtype=dtype, **weights,
            cuda_graphs=engine_config.cuda_graphs,
            **stage_graph_settings(policy, max_batch=1, warm_start=engine_config.warmup))
        self.decoder = StreamDecoder(self._decode, self.vocoder.samples_per_frame, self.vocoder.trim_samples)
        # stateful chunks (ChunkPolicy(stateful=True)): each request's vocoder state, as the code2wav stage keeps it
        self.streams = Code2WavStreamStates(self.vocoder.decode_stream, self.vocoder.state_specs(),
                                            self.vocoder.streaming_samples, self.device)
        # One vocoder thread, as the served code2wav stage has one instance: with every request's thread decoding
        # at once, 64 streams ran a GPU out of memory (each thread its own library handles and workspaces).
        self._vocoder_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="code2wav")
        self.policy = policy.resolved(exact_left_context_frames(self.vocoder.config))
        self.chunk_pacing = chunk_pacing
        if engine_config.warmup and not self.policy.stateful:  # the stage's warm start at batch 1 (stateful: graphs)
            warm_up_vocoder(self.vocoder, self.policy, max_batch=1)
        self.tokenizer = Tokenizer.from_file(str(Path(checkpoint_dir) / "tokenizer.json"))
        self._ids = itertools.count()

    def _audio_stream(self) -> Code2WavStream:
        pacer = ChunkPacer(self.policy) if self.chunk_pacing == "adaptive" else None
        return Code2WavStream(self.policy, self.vocoder.num_quantizers, pacer)

    def stream(self, client_inputs: Mapping[str, Any]) -> Iterator[tuple[str, torch.Tensor | None]]:
        """Client tensors (as the ``omni`` model takes them) -> (text delta, audio or None) as produced."""
        tensors = self.preprocessor({name: None if v is None else np.asarray(v) for name, v in client_inputs.items()})
        request_id = f"inprocess-{next(self._ids)}"
        clients = _DirectClients(self, tensors)
        session = Session(request_id,
                          SessionParams(return_audio=bool(tensors["RETURN_AUDIO"][0]),
                                        sequential=bool(tensors["SEQUENTIAL"][0])),
                          clients, IncrementalDetokenizer(self.tokenizer),
                          self._audio_stream)
        results: queue.SimpleQueue = queue.SimpleQueue()
        done = object()

        def run() -> None:
            try:
                session.run(lambda text, audio: results.put((text, audio)))
                results.put(done)
            except BaseException as exc:
                results.put(exc)

        threading.Thread(target=run, name=request_id, daemon=True).start()
        while (item := results.get()) is not done:
            if isinstance(item, BaseException):
                raise item
            yield item

    def generate(self, client_inputs: Mapping[str, Any]) -> tuple[str, np.ndarray]:
        """Whole text and waveform of one request."""
        text, audio = [], []
        for delta, samples in self.stream(client_inputs):
            text.append(delta)
            if samples is not None:
                audio.append(samples.float().cpu().numpy())
        return "".join(text), np.concatenate(audio) if audio else np.zeros(0, np.float32)

    def close(self) -> None:
        self.thinker.shutdown()
        self.talker.shutdown()
        self._vocoder_thread.shutdown()

    @torch.inference_mode()
    def _decode(self, codes: torch.Tensor) -> torch.Tensor:
        return self.vocoder.decode(codes)

    def decode_chunk(self, codes: torch.Tensor, left_context_frames: int) -> torch.Tensor:
        """codes [G, N] -> the samples after the left context (what the code2wav model returns)."""
        job = ChunkJob.after_context(codes, left_context_frames)
        return self._vocoder_thread.submit(self.decoder.decode, [job]).result()[0]

    def decode_stream_chunk(self, stream_id: str, codes: torch.Tensor, first: bool) -> torch.Tensor:
        """codes [G, n] new frames of stream ``stream_id`` -> their samples (the state stays in ``streams``)."""
        (samples,) = self._vocoder_thread.submit(self.streams.decode, [StreamChunk(stream_id, codes, first)]).result()
        if isinstance(samples, ValueError):
            raise samples
        return samples

    def close_stream(self, stream_id: str) -> None:
        self._vocoder_thread.submit(self.streams.close, stream_id).result()


def _cache_tokens(config: EngineConfig) -> int:
    return config.num_blocks * config.block_size


class _DirectClients:
    """StageClients that call the services in this process."""

    def __init__(self, pipeline: InProcessPipeline, tensors: Mapping[str, np.ndarray]):
        self.pipeline = pipeline
        self.tensors = tensors
        self.stream_id = f"stream-{next(pipeline._ids)}"

    def thinker(self, request_id: str) -> Iterator[ThinkerChunk]:
        outputs: queue.SimpleQueue = queue.SimpleQueue()
        service = self.pipeline.thinker
        service.submit(request_id, thinker_request(self.tensors, service.eos_token_ids), outputs.put)
        while True:
            out = outputs.get()
            if out.error is not None:
                raise StageFailed(f"thinker: {out.error}")
            yield ThinkerChunk(out.token_ids.tolist(), out.finished, payload=out)
            if out.finished:
                return

    def talker_start(self, request_id: str, chunk: ThinkerChunk) -> Iterator[torch.Tensor]:
        outputs: queue.SimpleQueue = queue.SimpleQueue()
        self.pipeline.talker.start(request_id, talker_request(self.tensors), chunk.payload, outputs.put)
        return self._frames(outputs)

    @staticmethod
    def _frames(outputs: queue.SimpleQueue) -> Iterator[torch.Tensor]:
        while True:
            out = outputs.get()
            if out.error is not None:
                raise StageFailed(f"talker: {out.error}")
            if out.codes.numel():
                yield out.codes
            if out.finished:
                return

    def talker_append(self, request_id: str, chunk: ThinkerChunk) -> None:
        self.pipeline.talker.append(request_id, chunk.payload)

    def merge_payloads(self, payloads: list[ThinkerOutput]) -> ThinkerOutput:
        return merge_appends(payloads)

    # ``urgent`` has nothing to go ahead of here: one process decodes each chunk when it is asked
    def code2wav(self, codes: torch.Tensor, left_context_frames: int, urgent: bool = False) -> torch.Tensor:
        return self.pipeline.decode_chunk(codes, left_context_frames)

    def code2wav_stream(self, codes: torch.Tensor, first: bool, urgent: bool = False) -> torch.Tensor:
        return self.pipeline.decode_stream_chunk(self.stream_id, codes, first)

    def code2wav_close(self) -> None:
        self.pipeline.close_stream(self.stream_id)

    def abort(self, request_id: str) -> None:
        self.pipeline.thinker.abort(request_id)
        self.pipeline.talker.abort(request_id)
