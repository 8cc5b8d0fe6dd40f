"""StageClients over Triton BLS: how the orchestrator reaches thinker, talker and code2wav.

Tensors returned by one stage are handed to the next as they are (``pb_utils.Tensor`` objects, on
the GPU when the stages run there), so no stage-to-stage hop goes through host memory. The talker
is a sequence-batched model: every chunk of one request carries the same correlation id, START on
the first, so they all reach the engine that holds that request's state. END comes last, on an abort request
sent once the frames stream ended (a no-op then) or to cancel the request: with several talker instances,
only a request on the sequence's own correlation id is sure to reach the instance that holds it.

With several pipelines (``serve --pipelines``) one client object serves one request on one pipeline: every call
goes to that pipeline's model of the stage (``models``: thinker -> thinker_p1, ...), aborts included.

``pb_utils`` is passed in because it only exists inside the Python backend stub.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
from typing import Any, Callable, Iterable, Iterator, Mapping

import numpy as np
import torch

from omni_triton.pipeline.session import ThinkerChunk
from omni_triton.stages.callers import caller_parameters
from omni_triton.stages.code2wav_call_log import send_stamp
from omni_triton.stages.stage_io import (THINKER_ROW_TENSORS, bls_stream, concat_rows, device_tensors_between_stages,
                                         from_torch, host_array, host_arrays, owned_copy, to_torch)

THINKER_OUTPUTS = ["TOKEN_IDS", "ROW_IDS", "EMBEDS", "HIDDEN", "PROMPT_LEN", "FINISHED"]
# Thinker outputs forwarded to the talker as they are (FINISHED becomes THINKER_FINISHED).
TALKER_FORWARDED = ["ROW_IDS", "EMBEDS", "HIDDEN", "PROMPT_LEN"]
THINKER_PARAMS = ["MAX_TOKENS", "MIN_TOKENS", "TEMPERATURE", "TOP_P", "TOP_K", "REPETITION_PENALTY", "SEED",
                  "IGNORE_EOS"]
TALKER_PARAMS = ["SPEAKER_ID", "TEMPERATURE", "TALKER_REPETITION_PENALTY", "SEED", "IGNORE_EOS", "MAX_AUDIO_FRAMES",
                 "MIN_AUDIO_FRAMES"]
# Chunks that go ahead of the others queued at the code2wav stage (its config: priority_levels 2, default 2):
# a stream's first chunk (the listener's first audio and the end of the stream's start; admission lets only a few
# streams start at once, so the time it waits behind other streams' chunks bounds requests/s), and an urgent one
# (its listener has little audio left: ``ChunkPacer.urgent``), which would otherwise run dry behind chunks of
# streams with seconds buffered.
AHEAD_PRIORITY = 1

_correlation_ids = itertools.count(1)


def _next_correlation_id() -> int:
    # Unique across orchestrator instances (separate stub processes) without coordination.
    return (os.getpid() << 32) | next(_correlation_ids)


class StageError(RuntimeError):
    """A downstream stage answered with an error; the message is the stage's own."""


class BlsStageClients:
    def __init__(self, pb_utils: Any, request_inputs: dict[str, Any], gpu: int | None,
                 check_device: Callable[..., None] = lambda *tensors: None,
                 stage_down: Callable[[str], bool] = lambda model: False, models: Mapping[str, str] | None = None):
        """``models``: stage -> the Triton model this request's calls to it go to (default: the stage's name)."""
        self._pb = pb_utils
        self._models = dict(models or {})
        self._stage_down = stage_down  # a call to a model that is down fails at once (it would wait 1-3 s)
        self._check_device = check_device  # counts inter-stage tensors that came back in host memory
        self._inputs = request_inputs  # the orchestrator's own validated input tensors, by name
        # stage outputs are asked for on the request's pipeline's GPU (``gpu``; None: on the CPU)
        on_device = gpu is not None and device_tensors_between_stages()
        self._memory = (pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_GPU, gpu) if on_device
                        else pb_utils.PreferredMemory(pb_utils.TRITONSERVER_MEMORY_CPU, 0))
        self._talker_correlation_id: int | None = None
        self._talker_ended = False
        self._talker_end_lock = threading.Lock()  # the frames reader and an abort may both end the sequence
        self._code2wav_stream_id: str | None = None  # set by the stream's first chunk

    # -- thinker -----------------------------------------------------------------------------------
    def thinker(self, request_id: str) -> Iterable[ThinkerChunk]:
        inputs = [self._inputs[name] for name in ("INPUT_IDS", "AUDIO_FEATURES", *THINKER_PARAMS)]
        request = self._request("thinker", inputs, THINKER_OUTPUTS, request_id=request_id)
        for response in bls_stream(request):
            outputs = self._outputs(response)
            if outputs is None:
                continue  # the empty final response that closes the stream
            # ids and flags are read on the host (text goes to the client); embeddings stay where they are
            self._check_device(outputs["EMBEDS"], outputs["HIDDEN"])
            token_ids, finished, prompt_len = host_arrays(outputs["TOKEN_IDS"], outputs["FINISHED"],
                                                          outputs["PROMPT_LEN"])
            # read with the ids in one wait, the prompt length goes on from the host: the talker's stub and
            # merge_payloads then read it without a wait of their own (one per append in the talker's execute)
            outputs["PROMPT_LEN"] = self._pb.Tensor("PROMPT_LEN", prompt_len)
            token_ids, finished = token_ids.reshape(-1).tolist(), bool(finished.reshape(-1)[0])
            yield ThinkerChunk(token_ids=token_ids, finished=finished, payload=outputs)

    # -- talker --------------------------------------------------------------------------------------
    def talker_start(self, request_id: str, chunk: ThinkerChunk) -> Iterator[torch.Tensor]:
        self._talker_correlation_id = _next_correlation_id()
        extra = [self._pb.Tensor(name, host_array(self._inputs[name]).reshape(1, -1)) for name in TALKER_PARAMS]
        request = self._talker_request(request_id, chunk, start=True, extra=extra)
        return self._frames(request_id, bls_stream(request))

    def talker_append(self, request_id: str, chunk: ThinkerChunk) -> None:
        # Sent under the lock that ends the sequence: a talker that reached its last frame before the thinker
        # finished has had its sequence ended, and a request after the END would not find it.
        with self._talker_end_lock:
            if self._talker_ended:
                return
            responses = bls_stream(self._talker_request(request_id, chunk, start=False, extra=[]))
        for response in responses:
            self._outputs(response)  # raises on error; append requests carry no outputs

    def merge_payloads(self, payloads: list[dict[str, Any]]) -> dict[str, Any]:
        """Thinker outputs past the first, as one: rows concatenated where they are (on the GPU: no host hop)."""
        if any(host_array(payload["PROMPT_LEN"]).reshape(-1)[0] for payload in payloads):
            raise ValueError("only thinker outputs past the first (no prompt rows) are merged")
        merged = {name: from_torch(self._pb, name, concat_rows([to_torch(payload[name]) for payload in payloads]))
                  for name in THINKER_ROW_TENSORS if name != "PROMPT_LEN"}
        return {**payloads[-1], **merged}

    def _talker_request(self, request_id: str, chunk: ThinkerChunk, *, start: bool, extra: list) -> Any:
        pb = self._pb
        flags = pb.TRITONSERVER_REQUEST_FLAG_SEQUENCE_START if start else 0  # END: _end_talker_sequence
        # the talker is sequence-batched, so every input carries a leading batch dim of 1
        finished = pb.Tensor("THINKER_FINISHED", np.array([[chunk.finished]], dtype=bool))
        inputs = [_batched(pb, chunk.payload[name], name) for name in TALKER_FORWARDED] + [finished, *extra]
        return self._request("talker", inputs, ["CODES"], request_id=request_id,
                             correlation_id=self._talker_correlation_id, flags=flags)

    def _frames(self, request_id: str, responses: Iterable[Any]) -> Iterator[torch.Tensor]:
        for response in responses:
            outputs = self._outputs(response)
            if outputs is not None and "CODES" in outputs:
                self._check_device(outputs["CODES"])
                # [1, n, G] on the talker's device: a copy of our own, as the frames are kept past this response
                codes = owned_copy(to_torch(outputs["CODES"]))
                codes = codes.reshape(-1, codes.shape[-1])
                if codes.numel():
                    yield codes
        self._end_talker_sequence(request_id)  # the stream ended: the talker holds nothing of it any more

    def _end_talker_sequence(self, request_id: str) -> None:
        """END the talker sequence (once) with an abort on its own correlation id: the sequence batcher routes
        it to the instance that holds the request, which drops what is left of it (nothing once its frames
        stream ended). A StageError means there is nothing left to drop: the stage forgot the request or is
        down (its state died with its process)."""
        pb = self._pb
        control = pb.Tensor("CONTROL", np.array([[b"abort"]], dtype=np.object_))  # batch dim: sequence-batched
        with contextlib.suppress(StageError):
            with self._talker_end_lock:
                if self._talker_correlation_id is None or self._talker_ended:
                    return
                self._talker_ended = True
                responses = bls_stream(self._request("talker", [control], [], request_id=request_id,
                                                  correlation_id=self._talker_correlation_id,
                                                  flags=pb.TRITONSERVER_REQUEST_FLAG_SEQUENCE_END))
            for response in responses:
                self._outputs(response)

    # -- code2wav ------------------------------------------------------------------------------------
    def code2wav(self, codes: torch.Tensor, left_context_frames: int, urgent: bool = False) -> torch.Tensor:
        """codes [G, N] on the stage device -> new audio samples (left context trimmed) on that device; an
        ``urgent`` chunk (and a stream's first, with no left context) goes ahead of those queued."""
        pb = self._pb
        codes = codes.to(torch.int64).unsqueeze(0)  # code2wav batches: [1, G, N]
        inputs = [from_torch(pb, "CODES", codes),
                  pb.Tensor("LEFT_CONTEXT", np.array([[left_context_frames]], dtype=np.int32))]
        audio = self._code2wav_call(inputs, ahead=urgent or left_context_frames == 0)["AUDIO"]
        self._check_device(audio)
        return to_torch(audio).reshape(-1)

    def code2wav_stream(self, codes: torch.Tensor, first: bool, urgent: bool = False) -> torch.Tensor:
        """codes [G, n] new frames on the stage device -> their samples; the code2wav stage keeps the vocoder
        state under this request's stream id (unique per orchestrator process and request). The first chunk and
        an ``urgent`` one go ahead of those queued."""
        pb = self._pb
        if first:
            self._code2wav_stream_id = f"{_next_correlation_id():x}"
        if self._code2wav_stream_id is None:
            raise ValueError("code2wav_stream: the first chunk of a stream must come first")
        inputs = [from_torch(pb, "CODES", codes.to(torch.int64).unsqueeze(0)), *self._stream_inputs(start=first)]
        audio = self._code2wav_call(inputs, ahead=first or urgent)["AUDIO"]
        self._check_device(audio)
        return to_torch(audio).reshape(-1)

    def code2wav_close(self) -> None:
        if self._code2wav_stream_id is None:
            return
        with contextlib.suppress(StageError):  # a stage that is down already lost the state
            self._code2wav_call(self._stream_inputs(end=True))
        self._code2wav_stream_id = None

    def _code2wav_call(self, inputs: list, ahead: bool = False) -> dict[str, Any]:
        """One code2wav request and its one response's outputs. The stage is decoupled (it answers from a thread
        of its own once the decode is done, ``deferred_sends``), so the call is a decoupled one. ``ahead``: sent
        at ``AHEAD_PRIORITY``."""
        outputs: dict[str, Any] = {}
        # stamped with its send time while tracing: the stage's call log says how long it took to get there
        parameters = {**send_stamp(), **({"priority": AHEAD_PRIORITY} if ahead else {})}
        for response in bls_stream(self._request("code2wav", inputs, ["AUDIO"], parameters=parameters)):
            outputs.update(self._outputs(response) or {})
        if "AUDIO" not in outputs:
            raise StageError("code2wav answered without AUDIO")
        return outputs

    def _stream_inputs(self, *, start: bool = False, end: bool = False) -> list:
        pb = self._pb
        return [pb.Tensor("STREAM_ID", np.array([[self._code2wav_stream_id.encode()]], dtype=np.object_)),
                pb.Tensor("STREAM_START", np.array([[start]], dtype=bool)),
                pb.Tensor("STREAM_END", np.array([[end]], dtype=bool))]

    # -- cancellation --------------------------------------------------------------------------------
    def abort(self, request_id: str) -> None:
        """Tell thinker and talker to drop the request (frees its KV blocks and pending chunks). A StageError
        means there is nothing left to free: the stage already forgot the request, or it is down (its state
        died with its process)."""
        control = self._pb.Tensor("CONTROL", np.array([b"abort"], dtype=np.object_))
        with contextlib.suppress(StageError):
            self._drain(self._request("thinker", [control], [], request_id=request_id))
        self._end_talker_sequence(request_id)

    # -- helpers -------------------------------------------------------------------------------------
    def _request(self, stage: str, inputs: list, outputs: list[str], **kwargs: Any) -> Any:
        model = self._models.get(stage, stage)
        if self._stage_down(model):
            raise StageError(f"{model} stage is down")
        # every request names this process, so that the stage drops it if this process dies (``callers``)
        kwargs["parameters"] = {**kwargs.get("parameters", {}), **caller_parameters()}
        return self._pb.InferenceRequest(model_name=model, inputs=inputs, requested_output_names=outputs,
                                         preferred_memory=self._memory, **kwargs)

    def _drain(self, request: Any) -> None:
        for response in bls_stream(request):
            self._outputs(response)

    def _outputs(self, response: Any) -> dict[str, Any] | None:
        if response.has_error():
            raise StageError(response.error().message())
        tensors = response.output_tensors()
        return {t.name(): t for t in tensors} if tensors else None


def _batched(pb: Any, tensor: Any, name: str) -> Any:
    """The same memory with a leading batch dim (a DLPack view: no copy, on whatever device)."""
    return from_torch(pb, name, to_torch(tensor).unsqueeze(0))
