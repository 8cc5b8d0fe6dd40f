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

The host share's time between steps while rows were runnable (the step thread's loop, not a step) is split
further, from the step log's gap fields (records from before it had them: no such rows): its length per gap;
the step thread's CPU time in steps and in those gaps (wall minus CPU: waits for the GPU, or for the GIL held
by the process's other threads); what the loop spent the gaps on: applying commands (adds, appends from the
thinker, aborts; how many per gap; the p50 of a gap with one add and of one append in gaps of appends only: what an
admission and an append cost the loop), the stats snapshots, queueing outputs for the response thread, waiting with
nothing to run, the step log itself, and the rest (the loop around them, the GIL); and the gaps' time off the
CPU while not waiting for a command (the GIL, or no core free). Garbage collection on the step thread is shown
apart (it runs inside any of those parts and inside steps).
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from omni_triton.bench.metric_rows import metric_row
from omni_triton.bench.metrics import mean, percentile

SHARES = ("gpu", "host", "input", "idle")
# the gap parts the loop times (step_log.GAP_PARTS), as the table names them
GAP_PARTS = {"commands": "applying commands", "stats": "stats snapshots", "outputs": "queueing outputs",
             "blocked": "blocked", "log": "step log"}
# (row label, metric keys, format) of the breakdown table, per engine; a cell needs every key of its row
TABLE_ROWS = (
    ("GPU % of wall", ("gpu_pct",), "{:.0f}"),
    ("host % of wall", ("host_pct",), "{:.0f}"),
    ("waiting for input % of wall", ("input_pct",), "{:.0f}"),
    ("idle % of wall", ("idle_pct",), "{:.0f}"),
    ("steps", ("steps",), "{:d}"),
    ("decode batch (mean rows)", ("decode_rows_mean",), "{:.1f}"),
    ("rows waiting for input (mean per step)", ("waiting_input_mean",), "{:.1f}"),
    ("decode step p50 (ms)", ("decode_step_p50_ms",), "{:.1f}"),
    ("prefill stalls of decoding rows (ms)", ("prefill_stall_ms",), "{:.0f}"),
    ("steps launched ahead %", ("ahead_pct",), "{:.0f}"),
    ("not ahead: top reasons", ("not_ahead_top",), "{}"),
    ("host: between steps, rows runnable % of wall", ("between_pct",), "{:.0f}"),
    ("between steps, rows runnable p50 / p95 (ms)", ("between_p50_ms", "between_p95_ms"), "{:.1f} / {:.1f}"),
    ("step thread CPU % of its wall (in steps / between steps)", ("cpu_in_steps_pct", "cpu_between_pct"),
     "{:.0f} / {:.0f}"),
    ("between steps: applying commands % of wall", ("commands_pct",), "{:.1f}"),
    ("between steps: commands per gap (mean)", ("commands_per_gap",), "{:.1f}"),
    ("between steps: commands per gap by kind (mean)", ("commands_by_kind",), "{}"),
    ("between steps: a gap with one add: applying its commands p50 (ms)", ("add_gap_commands_p50_ms",), "{:.1f}"),
    ("between steps: gaps of appends only: applying one p50 (ms)", ("append_commands_p50_ms",), "{:.2f}"),
    ("between steps: other parts % of wall", ("gap_parts",), "{}"),
    ("between steps: off the CPU, not blocked (the GIL, preempted) % of wall", ("off_cpu_pct",), "{:.1f}"),
    ("step thread garbage collection % of its wall (in steps / between steps)", ("gc_in_steps_pct", "gc_between_pct"),
     "{:.1f} / {:.1f}"),
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
        inside = [s for records in processes for s in records if _inside(s, start, end)]
        if not inside:
            continue
        seconds = dict.fromkeys(SECONDS, 0.0)
        for records in processes:
            for share, value in _process_seconds(records, start, end).items():
                seconds[share] += value
        wall = (end - start) * len(processes)
        result[engine] = {f"{share}_pct": 100 * value / wall for share, value in seconds.items()}
        result[engine].update(_step_stats(inside))
        gaps = [step for records in processes for step in _runnable_gaps(records, start, end)]
        result[engine].update(_gap_stats(inside, gaps, wall))
    return result


def _inside(step: dict, start: float, end: float) -> bool:
    return start < step["t"] and step["t"] - step["host_ms"] / 1e3 < end


# the four shares, and the host share's part between steps (rows runnable, the loop busy or waiting for the GIL)
SECONDS = (*SHARES, "between")


def _process_seconds(records: list[dict], start: float, end: float) -> dict[str, float]:
    """One engine process's window cut into the four shares (records in time order), and the host share's time
    between steps."""
    seconds = dict.fromkeys(SECONDS, 0.0)
    previous_end, left = start, None  # left: the previous step's record (what it left the engine with)
    for step in records + [None]:
        step_end = end if step is None else step["t"]
        step_start = end if step is None else step["t"] - step["host_ms"] / 1e3
        gap = _overlap(previous_end, step_start, start, end)
        share = _gap_share(left)
        seconds[share] += gap
        if share == "host":
            seconds["between"] += gap
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


def _runnable_gaps(records: list[dict], start: float, end: float) -> list[dict]:
    """The steps inside the window that followed a step leaving rows runnable (records in time order): their gap
    fields describe the host share's time between steps."""
    return [step for left, step in zip(records, records[1:])
            if left.get("left_runnable", 0) > 0 and step.get("gap_ms") is not None and _inside(step, start, end)]


def _gap_stats(steps: list[dict], gaps: list[dict], wall: float) -> dict:
    """The time between steps while rows were runnable (``gaps``: the steps after it), split by what the loop did
    there (``wall``: the engine's window, s, all its processes); None where the records lack the fields."""
    lengths = [gap["gap_ms"] for gap in gaps]
    timed_steps = [step for step in steps if "cpu_ms" in step]
    timed = [gap for gap in gaps if "gap_commands" in gap]  # (records from before the step log timed gaps: none)
    stats = {"between_p50_ms": percentile(lengths, 50), "between_p95_ms": percentile(lengths, 95),
             "cpu_in_steps_pct": _ratio_pct(timed_steps, "cpu_ms", "host_ms"),
             "gc_in_steps_pct": _ratio_pct(timed_steps, "gc_ms", "host_ms"),
             "cpu_between_pct": _ratio_pct(timed, "gap_cpu_ms", "gap_ms"),
             "gc_between_pct": _ratio_pct(timed, "gap_gc_ms", "gap_ms"),
             "commands_pct": None, "commands_per_gap": None, "commands_by_kind": None, "gap_parts": None,
             "off_cpu_pct": None, "add_gap_commands_p50_ms": None, "append_commands_p50_ms": None}
    if not timed:
        return stats
    part_ms = {part: sum(gap.get(f"gap_{part}_ms", 0.0) for gap in timed) for part in GAP_PARTS}
    rest_ms = sum(gap["gap_ms"] for gap in timed) - sum(part_ms.values())
    # the step thread neither ran nor waited for a command or the GPU: it waited for the GIL (or a core)
    off_cpu_ms = sum(gap["gap_ms"] - gap["gap_blocked_ms"] - gap["gap_cpu_ms"] for gap in timed)
    kinds = Counter()
    for gap in timed:
        kinds.update(gap["gap_commands_by_kind"])
    # what one admission and one append cost the loop (an admission's gap holds the appends that came with it)
    add_gaps = [gap["gap_commands_ms"] for gap in timed if gap["gap_commands_by_kind"].get("add") == 1]
    appends = [gap["gap_commands_ms"] / gap["gap_commands"] for gap in timed
               if gap["gap_commands"] and set(gap["gap_commands_by_kind"]) == {"append"}]
    stats.update(add_gap_commands_p50_ms=percentile(add_gaps, 50), append_commands_p50_ms=percentile(appends, 50))
    stats.update(commands_pct=_ms_pct(part_ms["commands"], wall), off_cpu_pct=_ms_pct(off_cpu_ms, wall),
                 commands_per_gap=mean([gap["gap_commands"] for gap in timed]),
                 commands_by_kind=", ".join(f"{kind} {n / len(timed):.1f}" for kind, n in kinds.most_common()) or "-",
                 gap_parts=", ".join(f"{GAP_PARTS[part]} {_ms_pct(ms, wall):.1f}" for part, ms in part_ms.items()
                                     if part != "commands") + f", rest {_ms_pct(rest_ms, wall):.1f}")
    return stats


def _ratio_pct(records: list[dict], part: str, whole: str) -> float | None:
    """100 * the sum of ``part`` over the sum of ``whole`` (records whose ``part`` is known); None without them."""
    known = [record for record in records if record.get(part) is not None]
    total = sum(record[whole] for record in known)
    return 100 * sum(record[part] for record in known) / total if total > 0 else None


def _ms_pct(ms: float, wall: float) -> float:
    return 100 * ms / 1e3 / wall


def markdown_rows(rows: list[dict]) -> list[str]:
    """Table lines (one column per level, as ``breakdown.markdown``) for the levels' ``engines`` metrics; a row
    only where a level has it (records from older traces lack some)."""
    engines = sorted({engine for row in rows for engine in row.get("engines", {})})
    lines = []
    for engine in engines:
        columns = [row.get("engines", {}).get(engine, {}) for row in rows]
        lines += [line for label, keys, fmt in TABLE_ROWS
                  if (line := metric_row(f"{engine} steps: {label}", columns, keys, fmt)) is not None]
    return lines
