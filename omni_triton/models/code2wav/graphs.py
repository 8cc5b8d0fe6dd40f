"""CUDA-graph replay of the Code2Wav vocoder's short calls (the torch backend's ``cuda_graphs`` option).

Why: a short call is launch-bound, not compute-bound. At full size on a GPU the first audio chunk (4 frames,
batch 1) takes ~31 ms eager -- hundreds of small conv / norm / elementwise launches, each paying Python and
launch latency -- and 2.8 ms replayed from a graph (benchmarks/results/h100-engine-fast). That chunk is on the
time-to-first-audio path of every request.

What is captured: one graph per (batch bucket, frame count), for frame counts up to ``max_frames``. A call's
batch is padded up to the smallest bucket that holds it (every size up to 8, then 16, 32, ... ``max_batch``:
``batch_buckets``) and its rows are copied out of the graph's output afterwards. Padding rows are zeros (valid
codes); every op of the vocoder is per row, so they do not touch the real rows. The frame count:

- one-pass decode (``forward(codes)``): never padded (more frames would change the samples at the end: the last
  frame's lookahead), so a replay runs exactly the kernels an eager call of the batch-padded shape runs and its
  output equals that call's bit for bit; one graph per frame count.
- streaming decode (``frame_buckets``): padded up to the smallest frame bucket that holds it
  (``stream_frame_buckets``: every count up to 8, then every 4th, and the chunk ramp's sizes exactly). That is
  the padding a batch of stream chunks already has (rows right-padded to the longest, each row's ``lengths`` saying where it ends:
  everything is causal and each state is read at the row's own end), so the samples keep their meaning; the
  waveform is cut back to the call's frames. 15 frame counts instead of 32 at the defaults.

When: the shapes a deployment knows it will see (``frames_at_start``: the first-chunk size; with the server's
warm start, every frame count, or frame bucket, up to ``max_frames``) are captured for every bucket when the
runtime is built, so no request pays a capture; any other short shape is captured on its first use (one warm-up
call + one capture, once per shape per process). A stage captures only the decode it serves
(``GraphSettings.for_stage`` / ``for_stream``): with stateful streaming, no one-pass graph at start. If such a
lazy capture fails, that shape stays eager (logged once): it is an optimisation, never a failure.

Warm-up before a capture: ``WARMUP_CALLS`` eager calls before a set's first capture (the capture stream's lazy
state: library handles, workspaces), one before every later one (that shape's own cuDNN/cuBLAS kernel choice).

Memory: every graph allocates from one private pool. Buffers freed at the end of one capture are reused by the
next, so the pool is about the largest graph's activations plus each graph's small output buffer. That sharing
is safe only because replays are serialised (``_lock``) and each replay's rows are copied out before the lock
is released: the next replay may overwrite the previous graph's output.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

import torch

from omni_triton.graph_buckets import bucket_for, capturing, collector_paused, fill_padded

# Frames past which a call runs eagerly. The pool, the output buffers and the number of distinct shapes (each a
# capture: about two eager calls' time on first use) grow with the bound, while the gain shrinks: the fixed
# ~25-30 ms of launches is most of a 4-frame call but a small part of a compute-bound long one (a later chunk,
# 25 new + up to 578 context frames: 62 ms of convolutions at batch 1). 32 covers the calls where TTFA is made:
# the first chunk (4 frames) and the second (8 new + 4 context = 12) under the default chunk ramp.
DEFAULT_MAX_FRAMES = 32
DEFAULT_MAX_BATCH = 8  # the code2wav stage's default max batch (LaunchConfig.code2wav_max_batch)
DEFAULT_FIRST_CHUNK_FRAMES = 4  # ChunkPolicy.first_chunk_frames
WARMUP_CALLS = 2  # before a set's first capture: cuDNN/cuBLAS pick and cache their kernels, lazy state settles
SHAPE_WARMUP_CALLS = 1  # before each later capture: the new shape's kernel choice (the stream's state is settled)
EVERY_FRAME_UP_TO = 8  # stream frame buckets: every count up to here (first chunks, where TTFA is made) ...
FRAME_STEP = 4  # ... then every 4th: a call padded by at most 3 frames, launch-bound at these sizes anyway
EVERY_BATCH_UP_TO = 8  # batch buckets: every size up to here (see batch_buckets), then doubling


def stream_frame_buckets(max_frames: int, exact: tuple[int, ...] = ()) -> tuple[int, ...]:
    """The frame counts a streaming graph set captures (a call's frames are padded up to the smallest that holds
    them): every count up to ``EVERY_FRAME_UP_TO``, then every ``FRAME_STEP``-th up to ``max_frames`` (always
    included), and the ``exact`` counts up to ``max_frames`` (the chunk ramp's sizes: the calls every stream
    makes, never padded)."""
    counts = {*range(1, min(EVERY_FRAME_UP_TO, max_frames) + 1),
              *range(EVERY_FRAME_UP_TO + FRAME_STEP, max_frames + 1, FRAME_STEP), max_frames,
              *(frames for frames in exact if 1 <= frames <= max_frames)}
    return tuple(sorted(counts))


@dataclass(frozen=True)
class GraphSettings:
    max_batch: int = DEFAULT_MAX_BATCH  # largest bucket; a larger batch runs eagerly
    max_frames: int = DEFAULT_MAX_FRAMES  # longest call replayed (see DEFAULT_MAX_FRAMES)
    frames_at_start: tuple[int, ...] = (DEFAULT_FIRST_CHUNK_FRAMES,)  # captured for every bucket at start
    # (): a graph per frame count. Else a call's frames are padded up to the smallest of these (ascending, the
    # last == max_frames): only for the streaming decode, whose rows carry their own lengths (module doc)
    frame_buckets: tuple[int, ...] = ()

    def __post_init__(self):
        if self.max_batch < 1 or self.max_frames < 1:
            raise ValueError(f"max_batch and max_frames must be >= 1, got {self.max_batch}, {self.max_frames}")
        if any(not 1 <= frames <= self.max_frames for frames in self.frames_at_start):
            raise ValueError(f"frames_at_start {self.frames_at_start} must be in [1, max_frames={self.max_frames}]")
        if self.frame_buckets:
            if (list(self.frame_buckets) != sorted(set(self.frame_buckets)) or self.frame_buckets[0] < 1
                    or self.frame_buckets[-1] != self.max_frames):
                raise ValueError(f"frame_buckets {self.frame_buckets} must ascend from >= 1 to max_frames="
                                 f"{self.max_frames}")
            if not set(self.frames_at_start) <= set(self.frame_buckets):
                raise ValueError(f"frames_at_start {self.frames_at_start} must be frame buckets "
                                 f"{self.frame_buckets}")

    @property
    def captures_at_start(self) -> int:
        """Graphs captured when the runtime is built: every start frame count at every batch bucket."""
        return len(self.frames_at_start) * len(batch_buckets(self.max_batch))

    @classmethod
    def for_stage(cls, max_batch: int, first_chunk_frames: int, every_short_call: bool = False,
                  served: bool = True) -> "GraphSettings":
        """A served stage's one-pass decode: buckets up to its max batch, its first chunk captured at start (and
        replayed even when a deployment makes it longer than the default bound: that chunk is where TTFA is
        made). ``every_short_call`` (warm start): every frame count up to the bound captured at start too, so no
        request pays a capture (chunk sizes vary per stream, and a batch is as long as its longest chunk).
        ``served=False`` (the stage streams with state: its chunks never take this decode): nothing at start,
        a direct caller's short call is captured on first use."""
        max_frames = max(DEFAULT_MAX_FRAMES, first_chunk_frames)
        # longest first: the pool is sized by the first capture, and every later one reuses its memory
        at_start = tuple(range(max_frames, 0, -1)) if every_short_call else (first_chunk_frames,)
        return cls(max_batch=max_batch, max_frames=max_frames, frames_at_start=at_start if served else ())

    @classmethod
    def for_stream(cls, max_batch: int, chunk_sizes: tuple[int, ...], every_short_call: bool = False,
                   served: bool = True) -> "GraphSettings":
        """A served stage's streaming decode: frame buckets (``frame_buckets``) with ``chunk_sizes`` (the chunk
        ramp's, the first chunk first) exact; at start the first chunk's bucket, or with ``every_short_call``
        (warm start) every frame bucket, at every batch bucket. ``served=False``: nothing at start."""
        first_chunk_frames = chunk_sizes[0]
        # up to the longest chunk (a deployment's --next-chunk-frames past the bound replays, not eager launches)
        max_frames = max(DEFAULT_MAX_FRAMES, *chunk_sizes)
        buckets = stream_frame_buckets(max_frames, chunk_sizes)
        at_start = tuple(reversed(buckets)) if every_short_call else (bucket_for(buckets, first_chunk_frames),)
        return cls(max_batch=max_batch, max_frames=max_frames, frames_at_start=at_start if served else (),
                   frame_buckets=buckets)


# ---------------------------------------------------------------- shape logic (pure, tested on the CPU)

def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """Every batch up to ``EVERY_BATCH_UP_TO``, then 16, 32, ... below ``max_batch``, then ``max_batch`` itself.

    Why every size at the served default (8): a replay's GPU time grows with its rows (stateful chunks of 25
    frames through graphs on an H200: 6.8 ms at one row, 21.6 at eight, ~2 ms a row), and at 64 streams the
    stage is busy 90% of the wall with calls of 3.7 chunks on average (h200-overlap-ahead): padded to 1, 2, 4, 8,
    a call of 3 ran 4 rows and one of 5 ran 8. Each extra size is one more graph per frame bucket (their
    activations share one pool; its outputs are a few MB), captured at start with the warm start."""
    buckets = list(range(1, min(EVERY_BATCH_UP_TO, max_batch) + 1))
    size = EVERY_BATCH_UP_TO * 2
    while size < max_batch:
        buckets.append(size)
        size *= 2
    return tuple(sorted({*buckets, max_batch}))


def graph_key(batch: int, frames: int, buckets: tuple[int, ...], max_frames: int,
              frame_buckets: tuple[int, ...] = ()) -> tuple[int, int] | None:
    """(bucket, frames) of the graph that replays a [batch, G, frames] call (frames: padded up to its frame
    bucket when there are ``frame_buckets``); None: the call runs eagerly."""
    bucket = bucket_for(buckets, batch)
    if bucket is None or frames > max_frames:
        return None
    return bucket, (bucket_for(frame_buckets, frames) if frame_buckets else frames)


def fill_padded_frames(static: torch.Tensor, values: torch.Tensor) -> None:
    """A graph's static codes [bucket, G, F]: ``values`` [b, G, n <= F] in the corner, zeros around (padding
    rows, and the frames past ``n``: the streaming decode's right padding, past each row's length)."""
    batch, _, frames = values.shape
    static[:batch, :, :frames].copy_(values)
    static[:batch, :, frames:].zero_()
    static[batch:].zero_()


def output_rows(static_output: torch.Tensor, batch: int, width: int | None = None) -> torch.Tensor:
    """The call's own rows of the graph's output (``width``: its first columns only, a frame-padded call's
    waveform), copied: the next replay overwrites the buffer."""
    return static_output[:batch, :width].clone() if width is not None else static_output[:batch].clone()


# ---------------------------------------------------------------- the graphs

@dataclass
class _CapturedCall:
    graph: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, ...]  # static inputs, batch first: codes [bucket, G, N] int64 (+ the stream state)
    outputs: tuple[torch.Tensor, ...]  # static outputs, batch first: waveform (+ new state), in the private pool


def zero_codes(bucket: int, frames: int, num_quantizers: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The one-pass decode's capture input: codes [bucket, G, frames] (zeros: valid codes)."""
    return (torch.zeros(bucket, num_quantizers, frames, dtype=torch.long, device=device),)


class Code2WavGraphs:
    """Captured graphs of ``forward`` (codes [B, G, N] int64 -> waveform [B, S] float32) on one CUDA device.

    ``run(codes)`` replays a graph when ``serves(codes.shape)``; callers run ``forward`` eagerly otherwise.
    Thread safe: captures and replay + copy-out hold one lock.

    The streaming decode (``forward(codes, lengths, *state) -> (waveform, *new_state)``) is captured the same way
    with ``capture_inputs`` building its inputs: every input and output has the batch first, padding rows are
    zeros (lengths 0: ``StreamingCode2Wav`` leaves such a row's state as it is) and ``run`` returns the tuple.
    """

    def __init__(self, forward: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]], num_quantizers: int,
                 device: torch.device, settings: GraphSettings = GraphSettings(),
                 capture_inputs: Callable[[int, int], tuple[torch.Tensor, ...]] | None = None):
        """``capture_inputs(bucket, frames)``: the static inputs of a capture (default: zero codes)."""
        if settings.frame_buckets and capture_inputs is None:
            raise ValueError("frame_buckets pad a call's frames: the streaming decode's (rows with lengths) only, "
                             "never the one-pass decode's (its last samples would change)")
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.forward = forward
        self.capture_inputs = capture_inputs or (lambda bucket, frames: zero_codes(bucket, frames, num_quantizers,
                                                                                   device))
        self.num_quantizers = num_quantizers
        self.device = device
        self.settings = settings
        self.buckets = batch_buckets(settings.max_batch)
        self._graphs: dict[tuple[int, int], _CapturedCall] = {}  # (bucket, frames) ->
        self._eager_shapes: set[tuple[int, int]] = set()  # lazy captures that failed: eager from then on
        self._lock = threading.Lock()
        self._pool = torch.cuda.graph_pool_handle()
        # One capture stream for every graph: the pool's memory is shared best when captures use the same stream.
        self._capture_stream = torch.cuda.Stream(device)
        # Ordering between a replay and the previous one's copy-out when callers run on different streams.
        self._last_copy_out: torch.cuda.Event | None = None
        self.replays = 0  # for tests and logs
        with self._lock, collector_paused():  # one garbage collection for the set, not one per graph
            for frames in settings.frames_at_start:
                for bucket in reversed(self.buckets):  # largest first: the smaller ones reuse its pool memory
                    self._capture(bucket, frames)

    @property
    def captured_shapes(self) -> set[tuple[int, int]]:
        return set(self._graphs)

    def serves(self, shape: torch.Size | tuple[int, ...]) -> bool:
        return self._key(shape) is not None

    def _key(self, shape: torch.Size | tuple[int, ...]) -> tuple[int, int] | None:
        batch, _, frames = shape
        return graph_key(batch, frames, self.buckets, self.settings.max_frames, self.settings.frame_buckets)

    @torch.inference_mode()
    def run(self, codes: torch.Tensor, *more: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """codes [b, G, N] int64 on the device (``serves(codes.shape)``) -> waveform [b, S] float32, equal to
        ``forward`` of ``codes`` zero-padded to the bucket (and to the frame bucket: then cut back to N frames'
        samples), rows [:b]. A shape whose capture failed runs ``forward`` (outside the lock). ``more``: the
        streaming decode's other inputs (then a tuple out)."""
        inputs = (codes, *more)
        batch, frames, key = codes.shape[0], codes.shape[2], self._key(codes.shape)
        stream = torch.cuda.current_stream(self.device)
        with self._lock:
            call = self._graphs.get(key)
            if call is None and key not in self._eager_shapes:
                call = self._capture_lazily(*key)
            if call is not None:
                if self._last_copy_out is not None:  # the previous replay's rows are out (its caller's stream)
                    stream.wait_event(self._last_copy_out)
                fill_padded_frames(call.inputs[0], codes)
                for static, value in zip(call.inputs[1:], more):
                    fill_padded(static, value, static.shape[0])
                call.graph.replay()
                waveform, *rest = call.outputs
                # the waveform is frames * samples per frame wide: a frame-padded call's own frames come first
                width = None if frames == key[1] else waveform.shape[1] // key[1] * frames
                outputs = (output_rows(waveform, batch, width), *(output_rows(static, batch) for static in rest))
                self._last_copy_out = torch.cuda.Event()
                self._last_copy_out.record(stream)
                self.replays += 1
                return outputs if more else outputs[0]
        return self.forward(*inputs)

    def _capture_lazily(self, bucket: int, frames: int) -> _CapturedCall | None:
        try:
            return self._capture(bucket, frames)
        except RuntimeError as error:  # e.g. an op this build cannot capture: keep serving, eagerly
            self._eager_shapes.add((bucket, frames))
            print(f"code2wav: CUDA graph capture of batch {bucket} x {frames} frames failed, that shape runs "
                  f"eagerly: {error}", flush=True)
            return None

    def _capture(self, bucket: int, frames: int) -> _CapturedCall:
        inputs = self.capture_inputs(bucket, frames)
        caller = torch.cuda.current_stream(self.device)
        # Warm-up calls on a side stream (torch's recipe for capture): the first calls of a shape pick and cache
        # cuDNN/cuBLAS kernels and workspaces, which must not happen inside the capture. After this set's first
        # capture the capture stream's own lazy state is settled: one call per new shape (its kernel choice).
        self._capture_stream.wait_stream(caller)
        with torch.inference_mode(), torch.cuda.stream(self._capture_stream):
            for _ in range(SHAPE_WARMUP_CALLS if self._graphs else WARMUP_CALLS):
                self.forward(*inputs)
        caller.wait_stream(self._capture_stream)
        graph = torch.cuda.CUDAGraph()
        # (capturing: other threads of the process, the engines' loops in the in-process pipeline or another
        # decode, may keep allocating and launching while this thread captures.)
        with torch.inference_mode(), capturing(graph, pool=self._pool, stream=self._capture_stream):
            outputs = self.forward(*inputs)
        call = _CapturedCall(graph, inputs, outputs if isinstance(outputs, tuple) else (outputs,))
        self._graphs[(bucket, frames)] = call
        return call
