"""Drive Triton's perf_analyzer over gRPC streams and read its per-request profile export.

perf_analyzer (tritonclient[all]==2.50.0 puts it in the environment's bin/) reports latency to the *first*
response of a decoupled model, which for `omni` is a text delta. Its --profile-export-file keeps each
request's send time, every response's arrival time and (2.50) each response's outputs, so TTFA is read
from there: the first response whose AUDIO holds samples. The export writes a tensor of one element, or an
empty one, as a bare number and longer tensors as lists; audio chunks are >= 1920 samples (one frame), so
"AUDIO is a non-empty list" is exactly "this response carries audio". An export without response outputs
(older builds) falls back to the time to the Nth response (--audio-response, stated in the summary).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

NS = 1e-9


class PerfAnalyzerUnavailable(RuntimeError):
    """No perf_analyzer binary, or it cannot start (missing shared libraries)."""


def find_perf_analyzer() -> Path:
    """$PERF_ANALYZER, else the one tritonclient installed next to this interpreter, else PATH."""
    explicit = os.environ.get("PERF_ANALYZER")
    candidates = [Path(explicit)] if explicit else [Path(sys.executable).parent / "perf_analyzer"]
    on_path = shutil.which("perf_analyzer")
    if not explicit and on_path:
        candidates.append(Path(on_path))
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise PerfAnalyzerUnavailable(f"no perf_analyzer at {[str(c) for c in candidates]}: set PERF_ANALYZER or "
                                  "pip install 'tritonclient[all]==2.50.0'")


def perf_analyzer_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """perf_analyzer links libcudart.so.12 even for CPU-only use: put pip's nvidia-cuda-runtime-cu12 libs on
    LD_LIBRARY_PATH (apt's libb64-0d must be installed too)."""
    env = dict(os.environ if base is None else base)
    try:
        import nvidia.cuda_runtime as cuda_runtime

        lib_dirs = [str(Path(p) / "lib") for p in cuda_runtime.__path__]
    except ImportError:
        lib_dirs = []
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (*lib_dirs, env.get("LD_LIBRARY_PATH", "")) if p)
    return env


def check_perf_analyzer(binary: Path) -> None:
    """Raise PerfAnalyzerUnavailable with the loader's message when the binary cannot run here."""
    result = subprocess.run([str(binary), "--version"], capture_output=True, text=True, env=perf_analyzer_env(),
                            timeout=60)
    output = result.stdout + result.stderr
    if "error while loading shared libraries" in output:
        raise PerfAnalyzerUnavailable(f"{binary} cannot start: {output.strip()} (needs apt libb64-0d and pip "
                                      "nvidia-cuda-runtime-cu12)")


def perf_analyzer_command(binary: Path, model: str, url: str, input_data: Path, export_file: Path, *,
                          concurrency: int | None = None, request_rate: float | None = None,
                          requests: int = 16, extra: list[str] = ()) -> list[str]:
    if (concurrency is None) == (request_rate is None):
        raise ValueError(f"give exactly one of concurrency ({concurrency}) and request_rate ({request_rate})")
    load = (["--concurrency-range", str(concurrency)] if concurrency is not None
            else ["--request-rate-range", str(request_rate)])
    # One load point per run: --request-count works only with a single level.
    return [str(binary), "-m", model, "-u", url, "-i", "grpc", "--streaming", "--input-data", str(input_data),
            *load, "--request-count", str(requests), "--profile-export-file", str(export_file), *extra]


@dataclass
class RequestRecord:
    latency_first_s: float
    latency_last_s: float
    responses: int
    ttft_s: float | None
    ttfa_s: float | None


def request_records(export: dict, audio_response: int = 2) -> tuple[list[RequestRecord], str]:
    """Per-request latencies from one profile export, and how TTFA was found ("AUDIO outputs" or
    "response #N"). ``audio_response`` is the 1-based response taken as the first audio without outputs."""
    records, ttfa_source = [], "AUDIO outputs"
    for experiment in export["experiments"]:
        for request in experiment["requests"]:
            sent = int(request["timestamp"])
            arrivals = [(int(t) - sent) * NS for t in request["response_timestamps"]]
            if not arrivals:
                continue
            outputs = request.get("response_outputs")
            if outputs:
                ttft = next((t for t, out in zip(arrivals, outputs) if out.get("TEXT_DELTA")), None)
                ttfa = next((t for t, out in zip(arrivals, outputs) if _has_samples(out.get("AUDIO"))), None)
            else:
                ttfa_source = f"response #{audio_response}"
                ttft = arrivals[0]
                ttfa = arrivals[audio_response - 1] if len(arrivals) >= audio_response else None
            records.append(RequestRecord(arrivals[0], arrivals[-1], len(arrivals), ttft, ttfa))
    return records, ttfa_source


def _has_samples(value) -> bool:
    return isinstance(value, list) and len(value) > 0


def export_span_s(export: dict) -> float:
    """First request sent -> last response received, over the whole export."""
    starts, ends = [], []
    for experiment in export["experiments"]:
        for request in experiment["requests"]:
            starts.append(int(request["timestamp"]))
            ends.extend(int(t) for t in request["response_timestamps"])
    return (max(ends) - min(starts)) * NS if starts and ends else 0.0


@dataclass
class PointSummary:
    model: str
    mode: str          # concurrency | request_rate
    value: float
    requests: int
    requests_per_s: float
    first_response_p50_s: float | None
    last_response_p50_s: float | None
    last_response_p95_s: float | None
    ttft_p50_s: float | None
    ttfa_p50_s: float | None
    ttfa_p95_s: float | None
    ttfa_p99_s: float | None
    ttfa_source: str

    def to_dict(self) -> dict:
        return asdict(self)


def summarize_export(model: str, mode: str, value: float, export: dict, audio_response: int = 2) -> PointSummary:
    records, source = request_records(export, audio_response)

    def pct(values, q):
        values = [v for v in values if v is not None]
        return float(np.percentile(values, q)) if values else None

    span = export_span_s(export)
    return PointSummary(
        model=model, mode=mode, value=value, requests=len(records),
        requests_per_s=len(records) / span if span else 0.0,
        first_response_p50_s=pct([r.latency_first_s for r in records], 50),
        last_response_p50_s=pct([r.latency_last_s for r in records], 50),
        last_response_p95_s=pct([r.latency_last_s for r in records], 95),
        ttft_p50_s=pct([r.ttft_s for r in records], 50),
        ttfa_p50_s=pct([r.ttfa_s for r in records], 50), ttfa_p95_s=pct([r.ttfa_s for r in records], 95),
        ttfa_p99_s=pct([r.ttfa_s for r in records], 99), ttfa_source=source)


def run_point(binary: Path, model: str, url: str, input_data: Path, out_dir: Path, *,
              concurrency: int | None = None, request_rate: float | None = None, requests: int = 16,
              extra: list[str] = (), timeout_s: float = 600.0, attempts: int = 3) -> tuple[PointSummary, Path]:
    """One perf_analyzer run at one load point; its stdout goes to <export>.log next to the export.

    perf_analyzer 2.50 now and then exits 0 with its multi-MB export cut at a 64 KiB boundary (seen in about
    1 run of 8 with audio outputs here): such a run is repeated, up to ``attempts`` runs in all."""
    mode, value = ("concurrency", concurrency) if concurrency is not None else ("request_rate", request_rate)
    export_file = out_dir / f"{model}-{mode}-{value}.json"
    command = perf_analyzer_command(binary, model, url, input_data, export_file, concurrency=concurrency,
                                    request_rate=request_rate, requests=requests, extra=list(extra))
    truncated = None
    for _ in range(attempts):
        export_file.unlink(missing_ok=True)  # perf_analyzer refuses to overwrite an export
        result = subprocess.run(command, capture_output=True, text=True, env=perf_analyzer_env(),
                                timeout=timeout_s)
        export_file.with_suffix(".log").write_text(" ".join(command) + "\n\n" + result.stdout + result.stderr)
        if result.returncode != 0 or not export_file.is_file():
            lines = (result.stdout + result.stderr).strip().splitlines()
            # A usage error prints the whole --help after the one line that matters.
            errors = [line for line in lines if "error" in line.lower()]
            tail = "\n".join(errors[:10] or lines[-15:])
            raise RuntimeError(f"perf_analyzer failed (exit {result.returncode}) on {model} {mode}={value}:\n{tail}")
        try:
            export = json.loads(export_file.read_text())
        except json.JSONDecodeError as error:
            truncated = error
            continue
        return summarize_export(model, mode, value, export), export_file
    raise RuntimeError(f"perf_analyzer wrote a truncated export {export_file} {attempts} times ({truncated})")
