"""Where each engine's wall time went during a benchmark level, from its step log (``engine/step_log.py``). Pure
functions.

Every instant of the level's window (its first request sent -> its last one finished) is, for each engine
process, in exactly one of:
- GPU: inside a step, within the step's GPU span (CUDA events; 0 on the CPU);
- host: inside a step but outside its GPU span (scheduling, building inputs, Python around the model), or
  between two steps while rows were runnable (the loop applying commands);
- waiting for input: between steps while no row could run but some held KV waiting for input (the talker
  waiting for thinker text: another process, or the orchestrator's hop);
- idle: between steps with nothing to do at all (no request, or requests still on their way in).
So the four shares add up to 100% of the window. Besides them: mean decode batch, mean rows waiting for input
per step, and prefill stalls: how much longer the steps that ran prefill next to decoding rows (mixed steps)
took than the median decode step (what those decoding streams waited for the prefill riding along). And how
often a step was launched before the previous one's tokens reached the host (overlapped steps, ``ahead``), with
the commonest reasons the next step was not (``not_ahead``, each as a share of all steps).
"""

from __future__ import annotations

from collections import Counter

import numpy as np

SHARES = ("gpu", "host", "input", "idle")
# (row label, metric key, format) of the breakdown table, per engine
TABLE_ROWS = (
    ("GPU % of wall", "gpu_pct", "{:.0f}"),
    ("host % of wall", "host_pct", "{:.0f}"),
    ("waiting for input % of wall", "input_pct", "{:.0f}"),
    ("idle % of wall", "idle_pct", "{:.0f}"),
    ("steps", "steps", "{:d}"),
    ("decode batch (mean rows)", "decode_rows_mean", "{:.1f}"),
    ("rows waiting for input (mean per step)", "waiting_input_mean", "{:.1f}"),
    ("decode step p50 (ms)", "decode_step_p50_ms", "{:.1f}"),
    ("prefill stalls of decoding rows (ms)", "prefill_stall_ms", "{:.0f}"),
    ("steps launched ahead %", "ahead_pct", "{:.0f}"),
    ("not ahead: top reasons", "not_ahead_top", "{}"),
)


def engine_shares(steps: list[dict], start: float, end: float) -> dict[str, dict]:
    """``steps``: step records (``trace.read_records(dir, "step")``, any processes); ``start``/``end``: the
    window (CLOCK_MONOTONIC s). -> ``{engine: metrics}`` for engines with a step inside the window."""
    by_process: dict[tuple[str, int], list[dict]] = {}
    for step in sorted(steps, key=lambda s: s["t"]):
        by_process.setdefault((step["engine"], step.get("pid", 0)), []).append(step)
    result: dict[str, dict] = {}
    for engine in sorted({engine for engine, _ in by_process}):
        processes = [records for (name, _), records in by_process.items() if name == engine]
        inside = [s for records in processes for s in records if start < s["t"] and s["t"] - s["host_ms"] / 1e3 < end]
        if not inside:
            continue
        seconds = dict.fromkeys(SHARES, 0.0)
        for records in processes:
            for share, value in _process_seconds(records, start, end).items():
                seconds[share] += value
        wall = (end - start) * len(processes)
        result[engine] = {f"{share}_pct": 100 * value / wall for share, value in seconds.items()}
        result[engine].update(_step_stats(inside))
    return result


def _process_seconds(records: list[dict], start: float, end: float) -> dict[str, float]:
    """One engine process's window cut into the four shares (records in time order)."""
    seconds = dict.fromkeys(SHARES, 0.0)
    previous_end, left = start, None  # left: the previous step's record (what it left the engine with)
    for step in records + [None]:
        step_end = end if step is None else step["t"]
        step_start = end if step is None else step["t"] - step["host_ms"] / 1e3
        gap = _overlap(previous_end, step_start, start, end)
        seconds[_gap_share(left)] += gap
        if step is None:
            break
        inside = _overlap(step_start, step_end, start, end)
        span = step_end - step_start
        gpu = 0.0 if step.get("gpu_ms") is None or span <= 0 else min(span, step["gpu_ms"] / 1e3) * inside / span
        seconds["gpu"] += gpu
        seconds["host"] += inside - gpu
        previous_end, left = max(previous_end, step_end), step
    return seconds


def _gap_share(left: dict | None) -> str:
    if left is None:
        return "idle"
    if left.get("left_runnable", 0) > 0:
        return "host"
    return "input" if left.get("left_waiting_input", 0) > 0 else "idle"


def _overlap(a: float, b: float, start: float, end: float) -> float:
    return max(0.0, min(b, end) - max(a, start))


def _step_stats(steps: list[dict]) -> dict:
    decode = [s for s in steps if s["kind"] == "decode"]
    mixed = [s for s in steps if s["kind"] == "mixed"]
    decode_p50 = float(np.percentile([s["host_ms"] for s in decode], 50)) if decode else None
    stall = sum(max(0.0, s["host_ms"] - decode_p50) for s in mixed) if decode_p50 is not None else None
    rows_with_decode = [s["decode_rows"] for s in steps if s["decode_rows"]]
    return {"steps": len(steps),
            "decode_rows_mean": float(np.mean(rows_with_decode)) if rows_with_decode else 0.0,
            "waiting_input_mean": float(np.mean([s["waiting_input"] for s in steps])),
            "decode_step_p50_ms": decode_p50, "mixed_steps": len(mixed), "prefill_stall_ms": stall,
            **_ahead_stats(steps)}


def _ahead_stats(steps: list[dict], top: int = 3) -> dict:
    """Share of steps launched ahead, and the ``top`` reasons the next step was not, as "reason N%" (shares of
    all steps); None for records from before the step log said so."""
    logged = [s for s in steps if "ahead" in s]
    if not logged:
        return {"ahead_pct": None, "not_ahead_top": None}
    commonest = Counter(s["not_ahead"] for s in logged if s.get("not_ahead") is not None).most_common(top)
    return {"ahead_pct": 100 * sum(bool(s["ahead"]) for s in logged) / len(logged),
            "not_ahead_top": ", ".join(f"{reason} {100 * n / len(logged):.0f}%" for reason, n in commonest) or "-"}


def markdown_rows(rows: list[dict]) -> list[str]:
    """Table lines (one column per level, as ``breakdown.markdown``) for the levels' ``engines`` metrics."""
    engines = sorted({engine for row in rows for engine in row.get("engines", {})})
    lines = []
    for engine in engines:
        for label, key, fmt in TABLE_ROWS:
            cells = [row.get("engines", {}).get(engine, {}).get(key) for row in rows]
            if any(cell is not None for cell in cells):
                lines.append(f"| {engine} steps: {label} | "
                             + " | ".join("" if c is None else fmt.format(c) for c in cells) + " |")
    return lines
