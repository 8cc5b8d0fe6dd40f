"""Per-request timings and the metrics computed from them (benchmarks/README.md, Metrics). Pure functions.

TTFA: request sent -> first non-empty audio chunk.   TTFT: request sent -> first non-empty text delta.
RTF: generation wall time / audio duration.          Continuity: fraction of requests whose audio never
underruns playback that starts when the first chunk arrives.
Dry time: how long a listener who starts playing at the first chunk hears silence after it (everything received
had already played); a stream "ran dry" when its dry time is > ``RAN_DRY_S``.
Gapless start delay: TTFA + dry time, how long a player must buffer before it starts to play without a gap.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields

import numpy as np

OUTPUT_SAMPLE_RATE = 24000
RAN_DRY_S = 0.050  # dry time above this is a gap a listener hears (benchmarks/README.md, Metrics)


@dataclass
class RequestTiming:
    """One request as its client saw it; every time is seconds since the request was sent."""

    text_times: list[float] = field(default_factory=list)             # arrival of each non-empty text delta
    audio_chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival, samples) per non-empty chunk
    total_s: float = 0.0                                               # until the stream closed
    error: str | None = None
    error_code: str | None = None  # a failure's Triton error code (client.error_code), or its exception's type

    @property
    def ok(self) -> bool:
        return self.error is None


def ttft(timing: RequestTiming) -> float | None:
    return timing.text_times[0] if timing.text_times else None


def ttfa(timing: RequestTiming) -> float | None:
    return timing.audio_chunks[0][0] if timing.audio_chunks else None


def audio_seconds(timing: RequestTiming, sample_rate: int = OUTPUT_SAMPLE_RATE) -> float:
    return sum(samples for _, samples in timing.audio_chunks) / sample_rate


def rtf(timing: RequestTiming, sample_rate: int = OUTPUT_SAMPLE_RATE) -> float | None:
    seconds = audio_seconds(timing, sample_rate)
    return timing.total_s / seconds if seconds > 0 else None


def underruns(audio_chunks: list[tuple[float, int]], sample_rate: int = OUTPUT_SAMPLE_RATE) -> int:
    """Chunks that arrive after the audio before them has finished playing (playback starts at the first
    chunk's arrival and never pauses by choice)."""
    if not audio_chunks:
        return 0
    start = audio_chunks[0][0]
    played_until = start
    late = 0
    for arrival, samples in audio_chunks:
        if arrival > played_until:
            late += arrival > start  # the first chunk starts playback; it cannot be late
            played_until = arrival   # the listener heard silence; playback resumes with this chunk
        played_until += samples / sample_rate
    return late


def dry_time(audio_chunks: list[tuple[float, int]], sample_rate: int = OUTPUT_SAMPLE_RATE) -> float:
    """Seconds of silence after the first chunk for a player that starts at the first chunk's arrival, plays
    at real time and pauses while it has nothing: the most any chunk arrived after the real-time play time of
    its first sample, ``max_k(arrival_k - first_arrival - audio before k)``, or 0. The pauses add up to that
    running maximum, and it is also the least extra buffering that makes playback gapless: a player that
    starts ``dry_time`` later never waits for a chunk, one that starts any earlier does."""
    if not audio_chunks:
        return 0.0
    start = audio_chunks[0][0]
    dry = 0.0
    played_samples = 0
    for arrival, samples in audio_chunks:
        dry = max(dry, arrival - start - played_samples / sample_rate)
        played_samples += samples
    return dry


def gapless_start_delay(timing: RequestTiming, sample_rate: int = OUTPUT_SAMPLE_RATE) -> float | None:
    """TTFA + dry time: from the request sent, how long a player must wait before it plays without a gap."""
    first = ttfa(timing)
    return None if first is None else first + dry_time(timing.audio_chunks, sample_rate)


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def mean(values: list[float]) -> float | None:
    return float(np.mean(values)) if values else None


@dataclass
class LevelSummary:
    """One system at one concurrency: the row of the report."""

    system: str
    concurrency: int
    requests: int
    failed: int
    wall_s: float
    ttft_p50: float | None
    ttft_p95: float | None
    ttft_p99: float | None
    ttfa_p50: float | None
    ttfa_p95: float | None
    ttfa_p99: float | None
    rtf_mean: float | None
    rtf_p95: float | None
    audio_s_per_request: float | None  # systems may not return exactly the frames asked for
    requests_per_s: float
    audio_s_per_s: float
    continuity: float | None
    errors: list[str] = field(default_factory=list)
    # What a listener hears (defaults: rows written before these metrics existed still load)
    dry_p50: float | None = None             # dry time after the first chunk, seconds
    dry_p95: float | None = None
    gapless_start_p50: float | None = None   # TTFA + dry time, seconds
    gapless_start_p95: float | None = None
    ran_dry: int | None = None               # streams whose dry time was > RAN_DRY_S
    ran_dry_fraction: float | None = None    # ... of the successful streams with audio
    gpu_memory_peak_gib: float | None = None  # device-wide, the most in use during the level (bench.gpu_memory)
    gpu_memory_peak_gib_per_gpu: list[float] | None = None  # the same per visible GPU, in nvidia-smi's order
    # a local server's processes (tritonserver, each stage instance's stub): CPU during the level, % of one core
    server_cpu_pct: dict[str, float] | None = None
    server_cpu_ms_per_request: dict[str, float] | None = None  # the same processes' CPU ms per completed request
    # Triton's statistics per model over the level (bench.scheduler_stats): requests, executions, mean ms queued...
    triton_models: dict[str, dict[str, float]] | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "LevelSummary":
        """The row ``to_dict`` wrote (a results.json row). ValueError naming what is missing or unknown: a row of
        another version would otherwise lose or invent metrics silently."""
        names = {f.name for f in fields(cls)}
        required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
        missing, unknown = sorted(required - set(data)), sorted(set(data) - names)
        if missing or unknown:
            raise ValueError(f"not a LevelSummary row: missing {missing}, unknown {unknown}")
        return cls(**{**data, "errors": list(data.get("errors", []))})


def summarize(system: str, concurrency: int, timings: list[RequestTiming], wall_s: float,
              sample_rate: int = OUTPUT_SAMPLE_RATE) -> LevelSummary:
    """Metrics over the successful requests of one level; throughput counts them over the level's wall time."""
    if wall_s <= 0:
        raise ValueError(f"wall_s must be > 0, got {wall_s}")
    done = [t for t in timings if t.ok]
    first_text = [v for v in map(ttft, done) if v is not None]
    first_audio = [v for v in map(ttfa, done) if v is not None]
    rtfs = [v for v in (rtf(t, sample_rate) for t in done) if v is not None]
    with_audio = [t for t in done if t.audio_chunks]
    continuous = [underruns(t.audio_chunks, sample_rate) == 0 for t in with_audio]
    dry = [dry_time(t.audio_chunks, sample_rate) for t in with_audio]
    gapless = [gapless_start_delay(t, sample_rate) for t in with_audio]
    ran_dry = sum(d > RAN_DRY_S for d in dry)
    return LevelSummary(
        system=system, concurrency=concurrency, requests=len(timings), failed=len(timings) - len(done),
        wall_s=wall_s,
        ttft_p50=percentile(first_text, 50), ttft_p95=percentile(first_text, 95), ttft_p99=percentile(first_text, 99),
        ttfa_p50=percentile(first_audio, 50), ttfa_p95=percentile(first_audio, 95),
        ttfa_p99=percentile(first_audio, 99),
        rtf_mean=mean(rtfs), rtf_p95=percentile(rtfs, 95),
        audio_s_per_request=mean([audio_seconds(t, sample_rate) for t in done]),
        requests_per_s=len(done) / wall_s,
        audio_s_per_s=sum(audio_seconds(t, sample_rate) for t in done) / wall_s,
        continuity=sum(continuous) / len(continuous) if continuous else None,
        errors=sorted({t.error for t in timings if t.error is not None}),
        dry_p50=percentile(dry, 50), dry_p95=percentile(dry, 95),
        gapless_start_p50=percentile(gapless, 50), gapless_start_p95=percentile(gapless, 95),
        ran_dry=ran_dry if with_audio else None, ran_dry_fraction=ran_dry / len(with_audio) if with_audio else None,
    )


# Ratios to the reference system: "lower is better" metrics divide system by reference (>1: slower).
RATIO_METRICS = ("ttft_p50", "ttfa_p50", "ttfa_p95", "rtf_mean", "audio_s_per_s")


def ratios_to(reference: str, summaries: list[LevelSummary]) -> list[dict]:
    """Each other system's metrics divided by the reference system's at the same concurrency."""
    by_level = {s.concurrency: s for s in summaries if s.system == reference}
    rows = []
    for summary in summaries:
        base = by_level.get(summary.concurrency)
        if summary.system == reference or base is None:
            continue
        row = {"system": summary.system, "concurrency": summary.concurrency}
        for metric in RATIO_METRICS:
            value, base_value = getattr(summary, metric), getattr(base, metric)
            row[metric] = value / base_value if value is not None and base_value else None
        rows.append(row)
    return rows
