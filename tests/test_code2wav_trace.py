"""The code2wav stage's call log (omni_triton/stages/code2wav_call_log.py), the deferred sends' report of each send,
and the code2wav rows of the trace breakdown (omni_triton/bench/code2wav_breakdown.py): the log on the CPU with
stand-in requests, the maths on synthetic records, then a real tritonserver serving a few streams traced."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from omni_triton import trace
from omni_triton.bench import breakdown, code2wav_breakdown
from omni_triton.stages.code2wav_call_log import SENT_PARAMETER, Code2WavCallLog, send_stamp
from omni_triton.stages.deferred_sends import DeferredSends, PendingResponse

CALL_FIELDS = {"record", "t", "pid", "requests", "chunks", "frames_max", "frames_total", "new_frames", "waited_ms",
               "gap_ms", "host_ms", "inputs_ms", "decode_host_ms", "gpu_ms", "send_queued_ms", "send_ms"}


class _Request:
    """A request as the stub hands it over: only its parameters (a JSON string) matter to the log."""

    def __init__(self, parameters: dict):
        self._parameters = json.dumps(parameters)

    def parameters(self) -> str:
        return self._parameters


def test_each_call_is_one_record_once_its_responses_are_out(traced):
    log = Code2WavCallLog(torch.device("cpu"))
    sent_at = time.monotonic_ns()
    first = log.begin([_Request({SENT_PARAMETER: sent_at}), _Request({}), _Request({SENT_PARAMETER: sent_at + 10**6})])
    with log.decoding(first):
        pass
    on_sent = log.when_sent(first)
    log.end(first, [(4, 4), (25, 25), (8, 8)])
    assert trace.read_records(traced, "code2wav_call") == []  # its responses are not out yet
    on_sent(first.t + 0.002, first.t + 0.005)
    (record,) = trace.read_records(traced, "code2wav_call")
    assert set(record) == CALL_FIELDS
    assert (record["requests"], record["chunks"], record["frames_max"], record["frames_total"],
            record["new_frames"]) == (3, 3, 25, 37, 37)
    assert record["waited_ms"] >= 0 and record["waited_ms"] == pytest.approx(
        (first.began - sent_at / 1e9) * 1e3)  # the oldest stamped request
    assert record["gap_ms"] is None and record["gpu_ms"] is None and record["host_ms"] >= 0
    assert record["send_queued_ms"] == pytest.approx(2) and record["send_ms"] == pytest.approx(3)
    assert record["t"] == first.t

    # the sending thread may finish before the execute returns (the export waits for the same decode): the record
    # then waits for the execute's end, and the send counts from there
    second = log.begin([_Request({})])
    log.when_sent(second)(second.began, second.began)
    log.end(second, [(30, 25)])
    record = trace.read_records(traced, "code2wav_call")[-1]
    assert record["waited_ms"] is None and record["gap_ms"] >= 0
    assert record["send_queued_ms"] == 0 and record["send_ms"] == 0
    assert (record["frames_total"], record["new_frames"]) == (30, 25)

    third = log.begin([_Request({})])  # a stream end alone: nothing decoded; never sent before the stage stops
    log.end(third, [])
    assert len(trace.read_records(traced, "code2wav_call")) == 2
    log.close()
    record = trace.read_records(traced, "code2wav_call")[-1]
    assert (record["chunks"], record["frames_max"], record["send_ms"]) == (0, 0, None)


class _Event:
    """A CUDA event as the log uses it, completed when the test says so (no GPU here)."""
    done = False

    def __init__(self, enable_timing=False):
        assert enable_timing

    def record(self, stream):
        pass

    def query(self):
        return _Event.done

    def synchronize(self):
        _Event.done = True

    def elapsed_time(self, end):
        assert _Event.done, "read before the GPU got there"
        return 12.5


def test_gpu_time_is_read_once_the_events_completed_never_waited_for(traced, monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: None)
    monkeypatch.setattr(_Event, "done", False)
    log = Code2WavCallLog(torch.device("cuda", 0))
    first = log.begin([])
    with log.decoding(first):
        pass
    log.end(first, [(4, 4)])
    log.when_sent(first)(first.t, first.t)
    assert trace.read_records(traced, "code2wav_call") == []  # sent, but its decode is still on the GPU
    second = log.begin([])  # a later call writes it once the GPU is done, ...
    assert trace.read_records(traced, "code2wav_call") == []
    with log.decoding(second):
        pass
    _Event.done = True
    log.end(second, [(8, 8)])
    (record,) = trace.read_records(traced, "code2wav_call")
    assert record["gpu_ms"] == 12.5 and record["frames_total"] == 4
    _Event.done = False
    log.close()  # ... and the stage's end waits for the rest, sent or not
    assert [(r["frames_total"], r["gpu_ms"], r["send_ms"]) for r in trace.read_records(traced, "code2wav_call")] \
        == [(4, 12.5, 0), (8, 12.5, None)]


def test_tracing_off_logs_no_call_and_stamps_no_request(tmp_path):
    trace.configure(None)
    log = Code2WavCallLog(torch.device("cpu"))
    call = log.begin([_Request({})])
    assert call is None and log.when_sent(call) is None
    with log.decoding(call):
        pass
    log.end(call, [(4, 4)])
    log.close()
    assert send_stamp() == {} and not list(tmp_path.rglob("*.jsonl"))


def test_send_stamp_is_the_monotonic_clock_in_ns(traced):
    before = time.monotonic_ns()
    (stamp,) = send_stamp().values()
    assert before <= stamp <= time.monotonic_ns()


class _Sender:
    def __init__(self):
        self.sent = []

    def send(self, response, flags):
        self.sent.append(response)


class _Pb:
    TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1


def test_deferred_sends_report_each_send_and_survive_a_failing_report():
    sends = DeferredSends(_Pb(), torch.device("cpu"))
    sender, reported, done = _Sender(), [], threading.Event()

    def failing(started, ended):
        raise RuntimeError("a broken report")

    sends.send_after(None, [], [PendingResponse(sender, lambda: "a")], on_sent=failing)
    sends.send_after(None, [], [PendingResponse(sender, lambda: "b"), PendingResponse(sender, lambda: "c")],
                     on_sent=lambda started, ended: (reported.append((started, ended)), done.set()))
    assert done.wait(10)
    sends.close()
    assert sender.sent == ["a", "b", "c"]
    ((started, ended),) = reported
    assert started <= ended


# -- the breakdown's maths ---------------------------------------------------------------------------

def call(t, host_ms, chunks=2, frames_max=25, frames_total=None, gpu_ms=None, gap_ms=None, waited_ms=None,
         send_ms=1.0, send_queued_ms=0.0, pid=1):
    frames_total = chunks * frames_max if frames_total is None else frames_total
    return dict(record="code2wav_call", t=t, pid=pid, requests=chunks, chunks=chunks, frames_max=frames_max,
                frames_total=frames_total, new_frames=frames_total, host_ms=host_ms, inputs_ms=host_ms / 10,
                decode_host_ms=host_ms / 2, gpu_ms=gpu_ms, gap_ms=gap_ms, waited_ms=waited_ms, send_ms=send_ms,
                send_queued_ms=send_queued_ms)


def chunk(t, frames, reason, call_ms=10.0, request="r", urgent=False):
    return dict(record="code2wav_chunk", t=t, pid=9, request=request, frames=frames, context_frames=0,
                reason=reason, call_ms=call_ms, buffered_ms=None, urgent=urgent)


def test_call_stats_over_a_window():
    # window 0..1 s, one process: 4 calls in it (100 + 100 + 50 + 50 ms in execute, GPU 80 + 80 + 20 + 20 ms),
    # one stream end alone, and a call of another level
    calls = [call(0.2, 100, chunks=4, frames_max=25, frames_total=70, gpu_ms=80, waited_ms=30),
             call(0.4, 100, chunks=1, frames_max=25, gpu_ms=80, gap_ms=100, waited_ms=10),
             call(0.6, 50, chunks=2, frames_max=4, gpu_ms=20, gap_ms=150, waited_ms=20),
             call(0.9, 50, chunks=1, frames_max=8, gpu_ms=20, gap_ms=250, waited_ms=None),
             call(0.95, 10, chunks=0, frames_max=0, gap_ms=0),
             call(5.0, 100, chunks=64)]
    stats = code2wav_breakdown.code2wav_stats(calls, [], 0.0, 1.0)
    assert stats["calls"] == 5 and stats["calls_per_s"] == pytest.approx(4)  # calls that decoded
    assert stats["busy_pct"] == pytest.approx(31)
    assert stats["gpu_pct"] == pytest.approx(20)
    # chunks and frames per call count the calls that decoded (4, 1, 2, 1 chunks)
    assert stats["chunks_mean"] == pytest.approx(2) and stats["chunks_p95"] == pytest.approx(3.7)
    assert stats["frames_mean"] == pytest.approx((70 + 25 + 8 + 8) / 4)
    # decoded 111 frames in padded batches of 4*25 + 25 + 2*4 + 8 = 141
    assert stats["padding_pct"] == pytest.approx(100 * (1 - 111 / 141))
    assert stats["gpu_p50_ms"] == pytest.approx(50) and stats["host_p50_ms"] == pytest.approx(50)
    assert stats["gap_p50_ms"] == pytest.approx(125)
    assert stats["waited_p50_ms"] == pytest.approx(20) and stats["waited_p95_ms"] == pytest.approx(29)
    assert stats["new_frames"] == 111
    assert "chunk_frames_p50" not in stats  # no chunk records


def test_calls_are_clipped_to_the_window_and_processes_averaged():
    # two code2wav processes (pipelines): one busy the whole window, one for half of it
    calls = [call(1.5, 1000, gpu_ms=1000, pid=1), call(1.25, 500, gpu_ms=250, pid=2), call(3.0, 10, pid=1)]
    stats = code2wav_breakdown.code2wav_stats(calls, [], 1.0, 2.0)
    assert stats["calls"] == 2 and stats["calls_per_s"] == pytest.approx(2)
    assert stats["busy_pct"] == pytest.approx(100 * (0.5 + 0.25) / 2)  # inside the window only
    assert stats["gpu_pct"] == pytest.approx(100 * 1.25 / 2)
    assert code2wav_breakdown.code2wav_stats(calls, [], 10.0, 11.0) == {}


def test_chunk_stats_say_how_the_pacer_cut_the_chunks():
    chunks = [chunk(0.1, 4, "first", 20), chunk(0.3, 8, "ramp", 30), chunk(0.5, 3, "deadline", 40),
              chunk(0.6, 4, "first", 50, request="s"), chunk(0.8, 2, "final", 60, request="s"),
              chunk(2.0, 25, "ramp")]  # after the window
    stats = code2wav_breakdown.code2wav_stats([], chunks, 0.0, 1.0)
    assert stats["chunks_sent"] == 5 and stats["chunk_frames_p50"] == 4 and stats["chunk_sizes"] == 4
    assert stats["deadline_pct"] == pytest.approx(100 / 3)  # of the chunks after a stream's first
    assert stats["round_trip_p50_ms"] == pytest.approx(40)
    assert "calls" not in stats
    assert stats["urgent_pct"] == 0 and stats["urgent_round_trip_p50_ms"] is None


def test_chunk_stats_count_the_urgent_chunks_and_their_round_trips():
    chunks = [chunk(0.1, 4, "first", 20), chunk(0.3, 8, "ramp", 30, urgent=True),
              chunk(0.5, 3, "deadline", 50, urgent=True), chunk(0.7, 25, "ramp", 300)]
    stats = code2wav_breakdown.code2wav_stats([], chunks, 0.0, 1.0)
    assert stats["urgent_pct"] == pytest.approx(200 / 3)  # of the chunks after a stream's first
    assert stats["urgent_round_trip_p50_ms"] == pytest.approx(40)
    # a trace written before chunks went ahead as urgent says nothing of them: no figure, not 0%
    old = [{k: v for k, v in c.items() if k != "urgent"} for c in chunks]
    assert code2wav_breakdown.code2wav_stats([], old, 0.0, 1.0)["urgent_pct"] is None


def test_breakdown_table_gets_code2wav_rows_per_level():
    stats = code2wav_breakdown.code2wav_stats(
        [call(0.5, 100, chunks=3, gpu_ms=50, gap_ms=5, waited_ms=7)], [chunk(0.5, 8, "ramp")], 0.0, 1.0)
    row = {"system": "server", "concurrency": 8, "requests": 1, "segments": {}, "total_p50_ms": None,
           "code2wav": stats}
    table = breakdown.markdown([row, {**row, "concurrency": 64, "code2wav": {}}])
    assert "| code2wav calls/s | 1.0 |  |" in table
    assert "| code2wav chunks per call (mean / p95) | 3.0 / 3 |  |" in table
    assert "| code2wav decode GPU ms (p50 / p95) | 50.0 / 50.0 |  |" in table
    assert "| code2wav busy % of wall (in execute) | 10 |  |" in table
    assert "| code2wav execute: inputs / decode on the host ms (p50) | 10.0 / 50.0 |  |" in table
    assert "| code2wav gap between calls ms (p50 / p95) | 5.0 / 5.0 |  |" in table
    assert "| code2wav pacer chunk frames (p50) | 8 |  |" in table
    # a row needs every value it shows: no GPU time on the CPU, no row
    stats_cpu = code2wav_breakdown.code2wav_stats([call(0.5, 100)], [], 0.0, 1.0)
    table = breakdown.markdown([{**row, "code2wav": stats_cpu}])
    assert "decode GPU ms" not in table and "| code2wav calls/s | 1.0 |" in table


# -- served ----------------------------------------------------------------------------------------------

STREAMS = 3
REQUEST = dict(max_tokens=6, min_tokens=6, ignore_eos=True, max_audio_frames=12, min_audio_frames=12,
               temperature=0.0)


@pytest.mark.server
def test_served_streams_log_every_code2wav_call_and_chunk(tiny_checkpoint, tmp_path, monkeypatch):
    from server_fixture import start_server

    from omni_triton.client import OmniStreamClient
    from omni_triton.shared.settings import LaunchConfig

    server_trace, client_trace = tmp_path / "server-trace", tmp_path / "client-trace"
    monkeypatch.setenv(trace.TRACE_DIR_ENV, str(server_trace))  # the stubs inherit it
    handle = start_server(LaunchConfig(checkpoint_dir=tiny_checkpoint), tmp_path / "run")
    trace.configure(client_trace)

    def one_stream(seed: int):
        with OmniStreamClient(handle.grpc_url) as client:
            return client.stream("hello there", seed=seed, **REQUEST)

    try:
        with ThreadPoolExecutor(STREAMS) as pool:
            results = list(pool.map(one_stream, range(STREAMS)))
    finally:
        trace.configure(None)
        handle.server.stop()  # the code2wav stage writes what its sending thread had not written yet
    assert all(result.audio.size for result in results)
    records = trace.records_by_kind(server_trace)
    calls, chunks = records["code2wav_call"], records["code2wav_chunk"]
    assert calls and all(set(c) == CALL_FIELDS for c in calls)
    assert len({c["pid"] for c in calls}) == 1  # the code2wav stage's process, not the orchestrator's
    decoding = [c for c in calls if c["chunks"]]
    # every chunk a stream sent was decoded once, in some call; the stateful default decodes new frames only
    assert sum(c["chunks"] for c in decoding) == len(chunks)
    assert sum(c["new_frames"] for c in calls) == sum(c["frames_total"] for c in calls) \
        == sum(c["frames"] for c in chunks) == STREAMS * REQUEST["max_audio_frames"]
    assert all(1 <= c["chunks"] <= c["requests"] and c["frames_max"] * c["chunks"] >= c["frames_total"]
               for c in decoding)
    # orchestrator and stage stamp the same clock: each call waited a while since its send, and was answered
    assert all(c["waited_ms"] is not None and c["waited_ms"] >= 0 for c in decoding)
    assert all(c["host_ms"] > 0 and c["send_ms"] is not None and c["gpu_ms"] is None for c in calls)
    assert all(c["inputs_ms"] + c["decode_host_ms"] <= c["host_ms"] for c in calls)
    assert calls[0]["gap_ms"] is None or calls[0]["gap_ms"] >= 0  # (warm-up calls may come before)
    assert all(c["gap_ms"] >= 0 for c in calls[1:])
    by_stream: dict[str, list[dict]] = {}
    for record in chunks:
        by_stream.setdefault(record["request"], []).append(record)
    assert len(by_stream) == STREAMS
    for stream in by_stream.values():
        assert stream[0]["reason"] == "first" and {c["reason"] for c in stream[1:]} <= {"ramp", "deadline", "final"}
        assert sum(c["frames"] for c in stream) == REQUEST["max_audio_frames"]
        # a chunk went ahead of those queued at the stage exactly when its listener had under 0.5 s left
        assert not stream[0]["urgent"] and all(c["urgent"] == (c["buffered_ms"] < 500) for c in stream[1:])
    # the bench's breakdown of this level (the clients' window) reads them into its code2wav rows
    row = breakdown.level_row("server", STREAMS, client_trace, server_trace)
    stats = row["code2wav"]
    assert stats["calls"] == len(calls) and stats["chunks_sent"] == len(chunks)
    assert stats["chunks_mean"] >= 1 and stats["new_frames"] == STREAMS * REQUEST["max_audio_frames"]
    assert 0 < stats["busy_pct"] <= 100
    assert stats["urgent_pct"] == pytest.approx(
        100 * sum(c["urgent"] for c in chunks) / sum(c["reason"] != "first" for c in chunks))
    table = breakdown.markdown([row])
    for label in ("calls/s", "chunks per call (mean / p95)", "frames per call (mean)", "busy % of wall",
                  "gap between calls", "sent to execute ms", "deferred send ms", "pacer chunk frames (p50)"):
        assert f"| code2wav {label}" in table
