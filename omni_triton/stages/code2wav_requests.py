"""The code2wav stage's requests, parsed: Triton tensors -> left-context chunk jobs or a stream request.

Left-context chunks: CODES [b, G, N] + LEFT_CONTEXT [b, 1]. Stream chunks: CODES [1, G, n] (new frames) +
STREAM_ID, STREAM_START on a stream's first chunk, STREAM_END (CODES optional) to free its state. Every problem is
a ValueError naming the input. ``pb_utils`` is passed in: it only exists inside the Python backend stub.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omni_triton.engine.handoff import InputStream
from omni_triton.models.code2wav.vocoder import Code2WavConfig, check_code_range, code_embedding_rows
from omni_triton.pipeline.code2wav.stream_states import StreamChunk
from omni_triton.pipeline.code2wav.chunking import ChunkJob
from omni_triton.stages.stage_io import host_array, to_torch


@dataclass
class StreamRequest:
    stream_id: str
    chunk: StreamChunk | None  # None: STREAM_END alone
    end: bool  # free the stream's state after this request


class Code2WavRequests:
    def __init__(self, pb_utils: Any, config: Code2WavConfig, host_hops: Any, stream_runtime: str | None,
                 inputs: InputStream):
        """``stream_runtime``: None when the runtime keeps stream state, else its kind (for the error).
        ``inputs``: where CODES are copied and checked (the decode reads them after ``execute`` returned, when
        Triton may have reused the request's memory)."""
        self._pb = pb_utils
        self._inputs = inputs
        self._config = config
        self._embedding_rows = code_embedding_rows(config)
        self._host_hops = host_hops  # counts CODES that arrived in host memory on a GPU stage
        self._stateless_runtime = stream_runtime

    def parse(self, request: Any) -> list[ChunkJob] | StreamRequest:
        stream_id = self._pb.get_input_tensor_by_name(request, "STREAM_ID")
        return self._jobs(request) if stream_id is None else self._stream(request, stream_id)

    def _codes(self, request: Any):
        tensor = self._pb.get_input_tensor_by_name(request, "CODES")
        if tensor is None:
            return None
        self._host_hops.check(tensor)
        codes = to_torch(tensor)  # on the device the talker produced it on
        if codes.shape[-1] < 1:
            raise ValueError("CODES must hold at least one frame")
        (codes,) = self._inputs.owned_copies(
            [codes], check=lambda copy: check_code_range(copy, self._config.codebook_size, self._embedding_rows))
        return codes

    def _optional_host(self, request: Any, name: str):
        tensor = self._pb.get_input_tensor_by_name(request, name)
        return None if tensor is None else host_array(tensor).reshape(-1)

    def _jobs(self, request: Any) -> list[ChunkJob]:
        """CODES [b, G, N] + LEFT_CONTEXT [b, 1] -> b chunk jobs."""
        codes = self._codes(request)
        left_context = self._optional_host(request, "LEFT_CONTEXT")
        if codes is None or left_context is None:
            raise ValueError("CODES and LEFT_CONTEXT are needed for a chunk without STREAM_ID")
        num_frames = codes.shape[-1]
        jobs = []
        for row, context in enumerate(left_context.tolist()):
            if not 0 <= context < num_frames:
                raise ValueError(f"LEFT_CONTEXT must be in [0, {num_frames - 1}] for {num_frames} frames, "
                                 f"got {context}")
            jobs.append(ChunkJob.after_context(codes[row], context))
        return jobs

    def _stream(self, request: Any, stream_id_tensor: Any) -> StreamRequest:
        if self._stateless_runtime is not None:
            raise ValueError(f"STREAM_ID: this code2wav stage's runtime ({self._stateless_runtime}) keeps no stream "
                             "state (serve with --left-context-frames exact or a number)")
        ids = host_array(stream_id_tensor).reshape(-1)
        if ids.size != 1:
            raise ValueError(f"STREAM_ID must name one stream per request, got {ids.size}")
        stream_id = ids[0].decode() if isinstance(ids[0], bytes) else str(ids[0])
        start, end = (bool(flag[0]) if (flag := self._optional_host(request, name)) is not None else False
                      for name in ("STREAM_START", "STREAM_END"))
        codes = self._codes(request)
        if codes is None:
            if not end:
                raise ValueError(f"CODES is missing for stream {stream_id!r} (only a STREAM_END request may omit it)")
            return StreamRequest(stream_id, None, end=True)
        if codes.dim() != 3 or codes.shape[0] != 1:
            raise ValueError(f"CODES of a stream chunk must be [1, G, n], got {tuple(codes.shape)}")
        return StreamRequest(stream_id, StreamChunk(stream_id, codes[0], first=start), end)
