"""The orchestrator stage: admits requests and runs each one's Session on a worker thread.

The Triton model file only parses its config and hands requests here. Each request gets its own
thread because BLS decoupled calls in this Triton version return blocking iterators: one slow stage
must not stall the other streams. Admission is bounded: past ``max_inflight`` requests a new one is
refused at once with UNAVAILABLE instead of queueing without limit.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.utils.dlpack
from tokenizers import Tokenizer

from omni_triton.models.code2wav import Code2WavConfig, exact_left_context_frames
from omni_triton.pipeline.code2wav_stream import ChunkPolicy, Code2WavStream
from omni_triton.pipeline.detokenizer import IncrementalDetokenizer
from omni_triton.pipeline.session import Cancelled, Session, SessionParams
from omni_triton.server.bls_clients import BlsStageClients

logger = logging.getLogger(__name__)

REQUEST_INPUTS = ("INPUT_IDS", "AUDIO_FEATURES", "MAX_TOKENS", "MIN_TOKENS", "SPEAKER_ID", "TEMPERATURE", "TOP_P",
                  "TOP_K", "REPETITION_PENALTY", "SEED", "RETURN_AUDIO", "IGNORE_EOS", "MAX_AUDIO_FRAMES",
                  "MIN_AUDIO_FRAMES", "SEQUENTIAL")


class Orchestrator:
    def __init__(self, pb_utils: Any, checkpoint_dir: str, device: str, policy: ChunkPolicy, max_inflight: int):
        self._pb = pb_utils
        self._tokenizer = Tokenizer.from_file(str(Path(checkpoint_dir) / "tokenizer.json"))
        code2wav_config = Code2WavConfig.from_pretrained(checkpoint_dir)
        self._num_quantizers = code2wav_config.num_quantizers
        self._policy = policy.resolved(exact_left_context_frames(code2wav_config))
        self._on_gpu = device != "cpu"
        self._slots = threading.BoundedSemaphore(max_inflight)
        self._max_inflight = max_inflight
        self._pool = ThreadPoolExecutor(max_workers=max_inflight, thread_name_prefix="omni-request")
        self._request_counter = 0
        self._counter_lock = threading.Lock()
        self.active_requests = 0

    def submit(self, request: Any) -> None:
        """Start streaming ``request``; every response goes out through its response sender."""
        sender = request.get_response_sender()
        if not self._slots.acquire(blocking=False):
            error = self._pb.TritonError(f"server busy: {self._max_inflight} requests in flight "
                                         "(max_inflight_requests); retry later", self._pb.TritonError.UNAVAILABLE)
            sender.send(self._pb.InferenceResponse(error=error),
                        flags=self._pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            return
        inputs = {name: self._pb.get_input_tensor_by_name(request, name) for name in REQUEST_INPUTS}
        request_id = self._request_id(request)
        self._pool.submit(self._run, request, sender, inputs, request_id)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _request_id(self, request: Any) -> str:
        # Triton's own id may be empty or reused by clients; stages key their state on this one.
        with self._counter_lock:
            self._request_counter += 1
            return f"{request.request_id() or 'req'}#{self._request_counter}"

    def _run(self, request: Any, sender: Any, inputs: dict[str, Any], request_id: str) -> None:
        pb = self._pb
        send_lock = threading.Lock()
        self.active_requests += 1

        def emit(text: str, audio: torch.Tensor | None) -> None:
            outputs = [pb.Tensor("TEXT_DELTA", np.array([text.encode("utf-8")], dtype=np.object_))]
            if audio is None:
                outputs.append(pb.Tensor("AUDIO", np.zeros(0, dtype=np.float32)))
            else:
                audio = audio.to(torch.float32).contiguous()
                outputs.append(pb.Tensor.from_dlpack("AUDIO", torch.utils.dlpack.to_dlpack(audio)))
            with send_lock:
                sender.send(pb.InferenceResponse(outputs))

        try:
            session = Session(
                request_id,
                SessionParams(return_audio=_flag(inputs["RETURN_AUDIO"]), sequential=_flag(inputs["SEQUENTIAL"]),
                              stage_params=None),
                BlsStageClients(pb, inputs, self._on_gpu),
                IncrementalDetokenizer(self._tokenizer),
                lambda: Code2WavStream(self._policy, self._num_quantizers),
                is_cancelled=request.is_cancelled,
            )
            session.run(emit)
            final = pb.InferenceResponse([])
        except Cancelled:
            final = pb.InferenceResponse(error=pb.TritonError("request cancelled", pb.TritonError.CANCELLED))
        except Exception as exc:  # one request's failure is reported to its client, never raised into Triton
            logger.exception("request %s failed", request_id)
            final = pb.InferenceResponse(error=pb.TritonError(f"{type(exc).__name__}: {exc}"))
        finally:
            self.active_requests -= 1
            self._slots.release()
        with send_lock:
            sender.send(final, flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


def _flag(tensor: Any) -> bool:
    return bool(tensor.as_numpy().reshape(-1)[0])
