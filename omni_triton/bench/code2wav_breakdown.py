"""What bounds the code2wav stage during a benchmark level, from its call log (``stages/code2wav_call_log.py``:
``code2wav_call`` records, one per execute) and the orchestrator's chunk records (``pipeline/session.py``:
``code2wav_chunk``, one per chunk a request sent). Pure functions.

Read together, the rows tell three bounds apart:
- GPU-bound: the decode's GPU % of wall near 100 (per code2wav process), calls of many chunks;
- batch-starved: many calls of a chunk or two, busy % well below 100, gaps between calls short: the stage is
  ready but the chunks reach it one at a time (Triton batches only chunks of the same frame count: many chunk
  sizes, e.g. the pacer's deadline chunks, split the queue into small calls);
- queue-bound: busy % near 100 with short gaps, and a long wait from the orchestrator's send to the execute: the
  chunks queue behind calls whose host time (execute, or the deferred sends) exceeds their GPU time.
"""

from __future__ import annotations

import numpy as np

from omni_triton.bench.metric_rows import metric_row

# (row label, metric keys, format) of the breakdown table; a cell needs every key of its row
TABLE_ROWS = (
    ("calls/s", ("calls_per_s",), "{:.1f}"),
    ("chunks per call (mean / p95)", ("chunks_mean", "chunks_p95"), "{:.1f} / {:.0f}"),
    ("frames per call (mean)", ("frames_mean",), "{:.0f}"),
    ("padding % of decoded frames", ("padding_pct",), "{:.0f}"),
    ("decode GPU ms (p50 / p95)", ("gpu_p50_ms", "gpu_p95_ms"), "{:.1f} / {:.1f}"),
    ("execute host ms (p50 / p95)", ("host_p50_ms", "host_p95_ms"), "{:.1f} / {:.1f}"),
    ("execute: inputs / decode on the host ms (p50)", ("inputs_p50_ms", "decode_host_p50_ms"), "{:.1f} / {:.1f}"),
    ("busy % of wall (in execute)", ("busy_pct",), "{:.0f}"),
    ("GPU % of wall", ("gpu_pct",), "{:.0f}"),
    ("gap between calls ms (p50 / p95)", ("gap_p50_ms", "gap_p95_ms"), "{:.1f} / {:.1f}"),
    ("sent to execute ms (p50 / p95)", ("waited_p50_ms", "waited_p95_ms"), "{:.1f} / {:.1f}"),
    ("deferred send ms (p50 / p95)", ("send_p50_ms", "send_p95_ms"), "{:.1f} / {:.1f}"),
    ("send queued behind earlier calls ms (p95)", ("send_queued_p95_ms",), "{:.1f}"),
    ("pacer chunk frames (p50)", ("chunk_frames_p50",), "{:.0f}"),
    ("pacer distinct chunk sizes", ("chunk_sizes",), "{:d}"),
    ("pacer chunks cut short by the deadline (% of those after the first)", ("deadline_pct",), "{:.0f}"),
    ("chunk round trip from the orchestrator ms (p50 / p95)", ("round_trip_p50_ms", "round_trip_p95_ms"),
     "{:.1f} / {:.1f}"),
    ("chunks sent ahead as urgent (% of those after the first)", ("urgent_pct",), "{:.0f}"),
    ("urgent chunk round trip ms (p50 / p95)", ("urgent_round_trip_p50_ms", "urgent_round_trip_p95_ms"),
     "{:.1f} / {:.1f}"),
)


def code2wav_stats(calls: list[dict], chunks: list[dict], start: float, end: float) -> dict:
    """``calls``: ``code2wav_call`` records, ``chunks``: ``code2wav_chunk`` records (any processes); ``start`` /
    ``end``: the level's window (CLOCK_MONOTONIC s). -> the metrics of ``TABLE_ROWS`` that the records inside
    the window give ({} without any). ``calls`` counts every execute; calls/s and the per-call chunks and frames
    count those that decoded (an execute of stream ends alone decodes nothing); busy %, gaps, waits and sends
    count them all."""
    stats: dict = {}
    inside = [c for c in calls if start < c["t"] and c["t"] - c["host_ms"] / 1e3 < end]
    if inside:
        stats.update(_call_stats(inside, start, end))
    sent = [c for c in chunks if start < c["t"] <= end]
    if sent:
        stats.update(_chunk_stats(sent))
    return stats


def _call_stats(calls: list[dict], start: float, end: float) -> dict:
    wall = (end - start) * len({c.get("pid", 0) for c in calls})  # each code2wav process's own wall
    decoding = [c for c in calls if c["chunks"]]  # stream ends alone decode nothing
    busy = sum(_overlap(c["t"] - c["host_ms"] / 1e3, c["t"], start, end) for c in calls)
    gpu = [c["gpu_ms"] for c in decoding if c.get("gpu_ms") is not None]
    padded = sum(c["chunks"] * c["frames_max"] for c in decoding)
    stats = {"calls": len(calls), "calls_per_s": len(decoding) / (end - start), "busy_pct": 100 * busy / wall,
             "gpu_pct": 100 * sum(gpu) / 1e3 / wall if gpu else None,
             "new_frames": sum(c["new_frames"] for c in calls),
             "padding_pct": 100 * (1 - sum(c["frames_total"] for c in decoding) / padded) if padded else None}
    if decoding:
        stats.update(chunks_mean=float(np.mean([c["chunks"] for c in decoding])),
                     chunks_p95=_percentile([c["chunks"] for c in decoding], 95),
                     frames_mean=float(np.mean([c["frames_total"] for c in decoding])))
    for name, key in (("gpu", "gpu_ms"), ("host", "host_ms"), ("inputs", "inputs_ms"),
                      ("decode_host", "decode_host_ms"), ("gap", "gap_ms"), ("waited", "waited_ms"),
                      ("send", "send_ms"), ("send_queued", "send_queued_ms")):
        values = [c[key] for c in calls if c.get(key) is not None]
        stats[f"{name}_p50_ms"], stats[f"{name}_p95_ms"] = _percentile(values, 50), _percentile(values, 95)
    return stats


def _chunk_stats(chunks: list[dict]) -> dict:
    after_first = [c for c in chunks if c["reason"] != "first"]
    round_trips = [c["call_ms"] for c in chunks]
    # records written before chunks could go ahead as urgent have no "urgent": no figure then
    urgent = [c for c in after_first if c.get("urgent")]
    urgent_known = bool(after_first) and all("urgent" in c for c in after_first)
    urgent_trips = [c["call_ms"] for c in urgent]
    return {"chunks_sent": len(chunks), "chunk_frames_p50": _percentile([c["frames"] for c in chunks], 50),
            "chunk_sizes": len({c["frames"] for c in chunks}),  # Triton batches only chunks of one size
            "deadline_pct": (100 * sum(c["reason"] == "deadline" for c in after_first) / len(after_first)
                             if after_first else None),
            "round_trip_p50_ms": _percentile(round_trips, 50), "round_trip_p95_ms": _percentile(round_trips, 95),
            "urgent_pct": 100 * len(urgent) / len(after_first) if urgent_known else None,
            "urgent_round_trip_p50_ms": _percentile(urgent_trips, 50),
            "urgent_round_trip_p95_ms": _percentile(urgent_trips, 95)}


def _percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _overlap(a: float, b: float, start: float, end: float) -> float:
    return max(0.0, min(b, end) - max(a, start))


def markdown_rows(rows: list[dict]) -> list[str]:
    """Table lines (one column per level, as ``breakdown.markdown``) for the levels' ``code2wav`` metrics."""
    columns = [row.get("code2wav", {}) for row in rows]
    return [line for label, keys, fmt in TABLE_ROWS
            if (line := metric_row(f"code2wav {label}", columns, keys, fmt)) is not None]
