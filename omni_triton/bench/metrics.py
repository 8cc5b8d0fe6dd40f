"""Per-request timings and the metrics computed from them (DESIGN.md section 6). Pure functions.

TTFA: request sent -> first non-empty audio chunk.   TTFT: request sent -> first non-empty text delta.
RTF: generation wall time / audio duration.          Continuity: fraction of requests whose audio never
underruns playback that starts when the first chunk arrives.
"""

from __future__ import annotations

from dataclasses import MISSING, asdict, dataclass, field, fields

import numpy as np

OUTPUT_SAMPLE_RATE = 24000


@dataclass
class RequestTiming:
    """One request as its client saw it; every time is seconds since the request was sent."""

    text_times: list[float] = field(default_factory=list)             # arrival of each non-empty text delta
    audio_chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival, samples) per non-empty chunk
    total_s: float = 0.0                                               # until the stream closed
    error: str | None = None

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
    gpu_memory_peak_gib: float | None = None  # device-wide, the most in use during the level (bench.gpu_memory)

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
