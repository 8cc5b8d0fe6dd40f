"""Triton's own account of each model during a benchmark level: requests and executions (the batch an execute
took), the time a request waited in the model's scheduler (queue: arrival -> handed to the backend) and the time
the backend took over it (compute). Read from the server's statistics API before and after the level, so for any
server the bench reaches, local or not.

What the trace's hops cannot tell apart: "talker request to the talker's stub" (30 ms p50 at 64 streams on the
H200) is Triton's scheduler (the talker's sequence batcher), its Python backend's parent or the stub's execute
thread busy with other requests. The queue time is the first; compute, for a Python-backend model, its ``execute``
(a decoupled model's returns before its responses are sent); BLS requests between stages are counted like any
other request.
"""

from __future__ import annotations

from typing import Any

# the statistics' duration kinds reported per model, and the name each has in a summary
DURATIONS = {"queue": "queue_ms", "compute_input": "input_ms", "compute_infer": "compute_ms",
             "compute_output": "output_ms"}


def model_counters(statistics: dict[str, Any]) -> dict[str, dict[str, int]]:
    """``get_inference_statistics(as_json=True)``'s answer -> model name -> counters: ``requests`` (inference
    count), ``executions``, and per duration kind its count and ns. The JSON writes 64-bit counts as strings and
    leaves zeros out; a model with several versions has them summed."""
    counters: dict[str, dict[str, int]] = {}
    for model in statistics.get("model_stats", []):
        into = counters.setdefault(model["name"], {})
        into["requests"] = into.get("requests", 0) + int(model.get("inference_count", 0))
        into["executions"] = into.get("executions", 0) + int(model.get("execution_count", 0))
        for kind in DURATIONS:
            duration = model.get("inference_stats", {}).get(kind, {})
            into[f"{kind}_count"] = into.get(f"{kind}_count", 0) + int(duration.get("count", 0))
            into[f"{kind}_ns"] = into.get(f"{kind}_ns", 0) + int(duration.get("ns", 0))
    return counters


def level_summary(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]) -> dict[str, dict[str, float]]:
    """Counters before and after a level -> model -> ``requests``, ``executions``, ``batch_mean`` and each
    duration's mean per request in ms, over the level alone; models without a request in it are left out (a
    model loaded in between has no interval to report)."""
    summary: dict[str, dict[str, float]] = {}
    for name in sorted(after):
        if name not in before:
            continue
        delta = {key: after[name].get(key, 0) - before[name].get(key, 0) for key in after[name]}
        if delta["requests"] <= 0:
            continue
        row = {"requests": delta["requests"], "executions": delta["executions"],
               "batch_mean": round(delta["requests"] / delta["executions"], 2) if delta["executions"] else None}
        for kind, label in DURATIONS.items():
            count = delta[f"{kind}_count"]
            row[label] = round(delta[f"{kind}_ns"] / count / 1e6, 3) if count > 0 else None
        summary[name] = row
    return summary


def read_counters(url: str) -> dict[str, dict[str, int]] | None:
    """Every model's counters from the server at ``url`` (gRPC host:port); None when it cannot be asked (no
    server there, or tritonclient absent): a level is measured without them rather than not at all."""
    try:
        import tritonclient.grpc as grpcclient

        with grpcclient.InferenceServerClient(url) as client:
            return model_counters(client.get_inference_statistics(as_json=True))
    except Exception:  # noqa: BLE001 (any failure to ask means: no statistics for this level)
        return None


class SchedulerStats:
    """``with SchedulerStats(url) as stats: ...`` then ``stats.summary``: ``level_summary`` over the block for the
    server at ``url``; None without a server or when either reading failed."""

    def __init__(self, url: str | None):
        self._url = url
        self.summary: dict[str, dict[str, float]] | None = None

    def __enter__(self) -> "SchedulerStats":
        self._before = read_counters(self._url) if self._url else None
        return self

    def __exit__(self, *exc) -> None:
        after = read_counters(self._url) if self._before is not None else None
        if after is not None:
            self.summary = level_summary(self._before, after)
