"""Where a request's time to first audio goes, from its trace events (``omni_triton.trace``). Pure functions.

A request's milestones, in the order they happen, and the segment that ends at each (the time from the
milestone before it). The served pipeline has every milestone; the in-process pipeline starts at
``session.start`` and has no client, orchestrator or gRPC hops. Segments whose end or start milestone is
missing are left out, so the segments present always add up to the span from the first to the last
milestone present: with ``client.sent`` and ``client.first_audio``, that is the client's TTFA.

The hand-offs between processes: "BLS request to the thinker", "talker request to the talker's stub" (since the
talker traces ``talker.received`` and ``talker.queued``, the talker request's hop splits in three: to the stub's
execute, its prefill built there, to the engine thread's ``talker.added``; traces without them hold one segment,
"talker request to its engine thread"), and, since the
engines trace ``<engine>.first_response`` (the first tokens handed to the stage's send), "first thinker chunk to the
orchestrator" and "first frame to the orchestrator"; in traces without it those two segments also hold the stage's
first chunk being made and held (the talker's first response waits for its first chunk's frames).

With the engines' step logs in the traces, each level's row (an open-loop rate's alike) also says where the
thinker's and the talker's wall time went during the level (GPU, host, waiting for input, idle; prefill stalls:
``step_breakdown.py``); with the code2wav stage's call log and the orchestrator's chunk records, what bounds
code2wav (its GPU, calls too small to fill it, or the way to it: ``code2wav_breakdown.py``).
"""

from __future__ import annotations

import numpy as np

from omni_triton.bench import code2wav_breakdown, step_breakdown

# (milestone, the segment that ends there)
MILESTONES = (
    ("client.sent", None),
    ("orchestrator.received", "gRPC in, ensemble, preprocess"),
    ("session.start", "orchestrator admission"),
    ("thinker.added", "BLS request to the thinker"),
    ("thinker.prefill_start", "thinker queueing"),
    ("thinker.first_token", "thinker prefill + first token"),
    ("thinker.first_response", "thinker's first chunk, held until sent"),
    ("session.thinker_first_chunk", "first thinker chunk to the orchestrator"),
    ("session.talker_start", "text out, talker request made"),
    ("talker.received", "talker request to the talker's stub"),
    ("talker.queued", "talker's prefill built (the stub's execute)"),
    ("talker.added", "talker request to its engine thread"),
    ("talker.prefill_start", "talker queueing"),
    ("talker.first_token", "talker prefill + first frame"),
    ("talker.first_response", "talker's first chunk of frames, made and held until sent"),
    ("session.talker_first_frames", "first frame to the orchestrator"),
    ("session.code2wav_first_call", "until the first chunk's frames"),
    ("session.code2wav_first_audio", "code2wav first chunk"),
    ("client.first_audio", "audio to host, response out"),
)
SEGMENTS = tuple(segment for _, segment in MILESTONES if segment is not None)


def request_segments(events: dict[str, float]) -> dict[str, float]:
    """One request's ``{event: time}`` -> ``{segment: seconds}`` between consecutive milestones present."""
    segments: dict[str, float] = {}
    previous: float | None = None
    for milestone, segment in MILESTONES:
        t = events.get(milestone)
        if t is None:
            continue
        if previous is not None and segment is not None:
            segments[segment] = t - previous
        previous = t
    return segments


def join_client_ids(events: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Merge each orchestrator request (``<client id>#<n>``) into its client's events, keyed by client id;
    ids without a client (the in-process pipeline's) stay as they are."""
    joined: dict[str, dict[str, float]] = {}
    for request_id, per_request in events.items():
        client_id = request_id.split("#", 1)[0]
        joined.setdefault(client_id, {}).update(per_request)
    return joined


def summarize(requests: list[dict[str, float]]) -> dict:
    """Median and p95 of each segment over requests (milliseconds), and the median first-to-last span."""
    per_request = [request_segments(events) for events in requests]
    per_request = [segments for segments in per_request if segments]
    table = {}
    for segment in SEGMENTS:
        values = [segments[segment] * 1e3 for segments in per_request if segment in segments]
        if values:
            table[segment] = {"p50_ms": float(np.percentile(values, 50)), "p95_ms": float(np.percentile(values, 95))}
    spans = [sum(segments.values()) * 1e3 for segments in per_request]
    return {"requests": len(per_request), "segments": table,
            "total_p50_ms": float(np.percentile(spans, 50)) if spans else None}


# A start, as admission counts it (stages/admission.py: admitted and not yet playing): from the orchestrator's
# admission to its first audio chunk (the orchestrator sends it at once; the client's receipt where the server's
# own milestone is missing).
START_BEGINS, START_ENDS = "session.start", ("session.code2wav_first_audio", "client.first_audio")


def starting_stats(requests: list[dict[str, float]], start: float, end: float) -> dict:
    """Streams in their start over the window [start, end]: how many at once on average (the starts' summed time
    inside the window over its length: Little's law's L, measured), the most at once, and a start's mean length.

    Why: admission lets at most ``--admission-max-starting`` streams start at once (a burst of starts stalls the
    playing streams), so with a queue of waiting requests the rate is at most that limit over a start's mean
    length. A mean near the limit says starts set the level's requests/s; a faster start raises it."""
    intervals = []
    for events in requests:
        ends = [events[name] for name in START_ENDS if name in events]
        if START_BEGINS in events and ends:
            intervals.append((events[START_BEGINS], min(ends)))
    if not intervals or end <= start:
        return {}
    inside = sum(max(0.0, min(stop, end) - max(begin, start)) for begin, stop in intervals)
    at_once = most = 0
    # ends before starts at the same instant: a stream that starts as another plays is not counted with it
    for _, change in sorted([(begin, 1) for begin, _ in intervals] + [(stop, -1) for _, stop in intervals]):
        at_once += change
        most = max(most, at_once)
    return {"starting_mean": inside / (end - start), "starting_max": most,
            "start_mean_ms": 1e3 * float(np.mean([stop - begin for begin, stop in intervals]))}


def _starting_rows(rows: list[dict]) -> list[str]:
    stats = [row.get("starting") or {} for row in rows]
    if not any(stats):
        return []
    return ["| streams starting at once (mean / most; admitted -> first audio) | "
            + " | ".join(f"{s['starting_mean']:.1f} / {s['starting_max']}" if s else "" for s in stats) + " |",
            "| a start, admitted -> first audio (mean ms) | "
            + " | ".join(f"{s['start_mean_ms']:.0f}" if s else "" for s in stats) + " |"]


def _column_name(row: dict) -> str:
    """A row's column header: ``server c32`` for a closed-loop level, ``server 12/s`` for an open-loop rate."""
    level = f"{row['rate']:g}/s" if "rate" in row else f"c{row['concurrency']}"
    return f"{row['system']} {level}"


def markdown(rows: list[dict]) -> str:
    """``rows``: ``level_row``'s or ``rate_row``'s -> one table, a column per system and level (or rate)."""
    if not rows:
        return ""
    header = [_column_name(row) for row in rows]
    lines = ["| segment (p50 ms) | " + " | ".join(header) + " |", "|---|" + "---:|" * len(rows)]
    for segment in SEGMENTS:
        cells = [row["segments"].get(segment, {}).get("p50_ms") for row in rows]
        if any(cell is not None for cell in cells):
            lines.append(f"| {segment} | " + " | ".join("" if c is None else f"{c:.1f}" for c in cells) + " |")
    lines.append("| **sum (first to last milestone)** | "
                 + " | ".join("" if row["total_p50_ms"] is None else f"**{row['total_p50_ms']:.1f}**" for row in rows)
                 + " |")
    lines.append("| requests | " + " | ".join(str(row["requests"]) for row in rows) + " |")
    lines += _starting_rows(rows)
    lines += step_breakdown.markdown_rows(rows)
    lines += code2wav_breakdown.markdown_rows(rows)
    return "\n".join(lines) + "\n"


def report_section(rows: list[dict]) -> str:
    """The results.md section for a report's ``ttfa_breakdown`` rows ("" without any)."""
    if not rows:
        return ""
    return ("\nWhere the time to first audio goes (p50 per segment, from request traces; "
            "omni_triton/bench/breakdown.py):\n\n" + markdown(rows))


def level_row(system: str, concurrency: int, level_dir, server_dir=None) -> dict:
    """The breakdown of one closed-loop level: the client's (or the in-process pipeline's) events in
    ``level_dir``, joined with the server's from ``server_dir`` for the requests this level sent."""
    return {"system": system, "concurrency": concurrency, **_traced_window(level_dir, server_dir)}


def rate_row(system: str, rate: float, rate_dir, server_dir=None) -> dict:
    """The breakdown of one open-loop rate (requests/s), as ``level_row``'s of a level: its requests' events in
    ``rate_dir``, the server's from ``server_dir``."""
    return {"system": system, "rate": rate, **_traced_window(rate_dir, server_dir)}


def _traced_window(local_dir, server_dir) -> dict:
    """Segments, starts, engine and code2wav metrics of the requests traced in ``local_dir`` (joined with their
    server events in ``server_dir``, a directory every level's requests share) over their window: the first
    request sent -> the last event (client.finished)."""
    from omni_triton.trace import read_events, records_by_kind

    local = read_events(local_dir)
    served = join_client_ids(read_events(server_dir)) if server_dir is not None else {}
    requests = [{**served.get(request_id, {}), **events} for request_id, events in local.items()]
    row = summarize(requests)
    times = [t for events in local.values() for t in events.values()]
    if times:
        read = [records_by_kind(local_dir)] + ([records_by_kind(server_dir)] if server_dir is not None else [])

        def records(kind: str) -> list[dict]:
            return [record for by_kind in read for record in by_kind.get(kind, [])]

        start, end = min(times), max(times)
        row["starting"] = starting_stats(requests, start, end)
        row["engines"] = step_breakdown.engine_shares(records("step"), start, end)
        row["code2wav"] = code2wav_breakdown.code2wav_stats(records("code2wav_call"), records("code2wav_chunk"),
                                                            start, end)
    return row
