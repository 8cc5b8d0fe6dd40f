"""Chunk sizes that follow the stream: when to decode the codec frames one stream has pending.

The fixed ramp (``ChunkPolicy.chunk_size``: 4, 8, 24, 25, ... frames) assumes frames come fast enough to fill
each chunk before the audio before it has played. Under load they do not: a stream that gets frames at 1.2x
real time waits for 25 frames (2 s of generation) while its listener has 0.3-1 s buffered, and runs dry.

``ChunkPacer`` decides per stream, from what that stream is getting:
- the listener's buffer: audio sent minus real time elapsed since the first chunk was sent (a player that pauses
  while it has nothing, as the bench's dry time counts it: after a gap, it plays on from where it stopped);
- how long the next frame takes to come (the longest recent gap between frame arrivals, so bursty streams
  count their pauses) and how long a decode call takes (the slowest recent one, a prior before any);
- a deadline: the last moment a decode may start and still land while the listener has ``margin_s`` left.
If the next look at the stream (the next frame, or the idle wake-up every ``poll_s``) would come after that
deadline, the pending frames are decoded now, however few; otherwise the stream waits for the ramp's size,
which grows to ``chunk_frames`` (fewer, larger calls: less per-call overhead and left-context recompute).
A stream below real time (its recent frame rate, or a listener already dry) gains nothing from single-frame
chunks: it cannot keep the listener fed however it cuts them, so its chunks are at least a first chunk's worth
of frames (a rebuffer) and it does not turn into one decode call per frame.

The first chunk stays the ramp's (``first_chunk_frames``): nothing is buffered and nothing is measured yet.

``urgent``: whether a chunk sent now should go ahead of the other streams' chunks queued at the code2wav stage
(the orchestrator sends it at the first chunk's priority): its listener has less than ``urgent_s`` of audio left.
At 64 streams on an H200 a later chunk waited 52-179 ms p50, 240-403 ms p95 at the stage before its call
(benchmarks/results/h200-variants-ab36502), so a listener with less than half a second buffered ran dry behind
chunks of streams that had seconds left. A chunk this pacer's deadline sends is urgent as long as a decode takes
under ``urgent_s`` - ``margin_s`` - ``poll_s`` (0.33 s by default).
Pure logic: times come in as arguments (``now``), so tests drive it with a simulated clock.
"""

from __future__ import annotations

from collections import deque

from omni_triton.pipeline.code2wav.chunking import ChunkPolicy

FRAME_S = 1 / 12.5  # audio per codec frame (12.5 frames per second)


class ChunkPacer:
    def __init__(self, policy: ChunkPolicy, *, frame_s: float = FRAME_S, margin_s: float = 0.12,
                 poll_s: float = 0.05, decode_prior_s: float = 0.1, history: int = 8, urgent_s: float = 0.5):
        """``margin_s``: audio the listener should still have when a chunk lands; ``poll_s``: how often the
        caller looks at the stream when no frame comes (``Session``'s idle wake-up); ``decode_prior_s``: the
        decode time assumed before one is measured; ``history``: recent gaps and decode times kept;
        ``urgent_s``: a chunk sent while the listener has less than this left is ``urgent``."""
        if margin_s < 0 or poll_s <= 0 or decode_prior_s < 0 or frame_s <= 0 or history < 1 or urgent_s < 0:
            raise ValueError(f"ChunkPacer: margin_s {margin_s}, decode_prior_s {decode_prior_s} and urgent_s "
                             f"{urgent_s} must be >= 0, poll_s {poll_s}, frame_s {frame_s} and history {history} > 0")
        self.policy = policy
        self.frame_s, self.margin_s, self.poll_s, self.decode_prior_s = frame_s, margin_s, poll_s, decode_prior_s
        self.urgent_s = urgent_s
        self._gaps: deque[float] = deque(maxlen=history)      # seconds between frame arrivals
        self._arrivals: deque[tuple[float, int]] = deque(maxlen=history + 1)  # (time, frames)
        self._arrived_frames = 0  # the frames of ``_arrivals``, kept as they come and go: asked at every frame
        self._decodes: deque[float] = deque(maxlen=history)   # seconds per decode call
        self._last_arrival: float | None = None
        self._plays_until: float | None = None  # when the listener's audio runs out; None: nothing sent yet

    # -- what the stream reports -----------------------------------------------------------------
    def frames_arrived(self, count: int, now: float) -> None:
        if count <= 0:
            return
        if self._last_arrival is not None:
            self._gaps.append(now - self._last_arrival)
        self._last_arrival = now
        if len(self._arrivals) == self._arrivals.maxlen:  # the oldest leaves as this one comes
            self._arrived_frames -= self._arrivals[0][1]
        self._arrivals.append((now, count))
        self._arrived_frames += count

    def decode_took(self, seconds: float) -> None:
        self._decodes.append(seconds)

    def audio_sent(self, seconds: float, now: float) -> None:
        self._plays_until = max(now, self._plays_until or now) + seconds

    # -- estimates ---------------------------------------------------------------------------------
    def buffered_s(self, now: float) -> float:
        """Audio the listener has not played yet; 0 when it is dry or has nothing yet."""
        return 0.0 if self._plays_until is None else max(0.0, self._plays_until - now)

    def next_frame_wait_s(self) -> float:
        """How long the next frame may take: the longest recent gap (one frame time before any)."""
        return max(self._gaps, default=self.frame_s)

    def frames_per_s(self) -> float | None:
        """The recent frame rate (frames after the oldest recent arrival over the time since it); None before
        two arrivals at different times."""
        if len(self._arrivals) < 2 or self._arrivals[-1][0] <= self._arrivals[0][0]:
            return None
        frames = self._arrived_frames - self._arrivals[0][1]
        return frames / (self._arrivals[-1][0] - self._arrivals[0][0])

    def decode_s(self) -> float:
        return max(self._decodes, default=self.decode_prior_s)

    def urgent(self, now: float) -> bool:
        """A chunk sent now should go ahead of the queued ones: the listener has audio and less than ``urgent_s``
        of it left, or has run dry (a stream's first chunk has a priority of its own: nothing was sent yet)."""
        return self._plays_until is not None and self.buffered_s(now) < self.urgent_s

    # -- the decision --------------------------------------------------------------------------------
    def chunk_size(self, decoded_frames: int, pending_frames: int, now: float) -> int:
        """New frames the next chunk should have: ``pending_frames`` or fewer means "decode that many now",
        more means "wait for them" (``Code2WavStream.next_job`` reads it that way)."""
        ramp = self.policy.chunk_size(decoded_frames)
        if decoded_frames == 0 or pending_frames == 0:
            return ramp
        if pending_frames >= ramp:
            return ramp
        buffered = self.buffered_s(now)
        rate = self.frames_per_s()
        keeping_up = buffered > 0 and (rate is None or rate * self.frame_s >= 1)
        smallest = 1 if keeping_up else min(ramp, self.policy.first_chunk_frames)  # else: rebuffer-sized chunks
        latest_start = buffered - self.margin_s - self.decode_s()  # seconds from now
        next_look = min(self.next_frame_wait_s(), self.poll_s)   # the idle wake-up looks sooner than a slow frame
        if next_look < latest_start:
            return ramp  # time enough: wait for a larger chunk
        # waiting any longer risks a gap: decode what there is (a stream behind real time: a rebuffer's worth)
        return pending_frames if pending_frames >= smallest else smallest
