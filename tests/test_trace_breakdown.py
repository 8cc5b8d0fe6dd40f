"""Request traces (omni_triton.trace) and the TTFA breakdown built from them (omni_triton.bench.breakdown):
the pure joins and sums, then a real in-process pipeline and a real tritonserver writing the traces (and the open
loop's `bench --request-rate --trace` reading that server's)."""

from __future__ import annotations

import json

import pytest

from omni_triton import trace
from omni_triton.bench import breakdown
from omni_triton.bench.breakdown import MILESTONES, SEGMENTS, join_client_ids, request_segments

REQUEST = dict(max_tokens=6, min_tokens=6, ignore_eos=True, max_audio_frames=8, min_audio_frames=8,
               temperature=0.0, seed=3)


def test_events_are_written_per_process_and_read_back_earliest_first(traced):
    trace.event("a#1", "session.start")
    trace.event("a#1", "session.start")  # a repeat (e.g. after a preemption) keeps the first time
    trace.event("b", "thinker.added", tokens=3)
    events = trace.read_events(traced)
    assert set(events) == {"a#1", "b"}
    assert list(events["b"]) == ["thinker.added"]
    lines = [line for path in traced.glob("*.jsonl") for line in path.read_text().splitlines()]
    assert len(lines) == 3
    assert events["a#1"]["session.start"] == min(float(line.split('"t": ')[1].split(",")[0])
                                                 for line in lines if '"a#1"' in line)


def test_tracing_off_writes_nothing(tmp_path):
    trace.configure(None)
    trace.event("x", "session.start")
    assert not trace.enabled()
    assert not list(tmp_path.rglob("*.jsonl"))


def test_segments_add_up_to_the_span_and_skip_missing_milestones():
    times = {name: float(i) ** 1.5 for i, (name, _) in enumerate(MILESTONES)}
    segments = request_segments(times)
    assert list(segments) == list(SEGMENTS)
    assert sum(segments.values()) == pytest.approx(times["client.first_audio"] - times["client.sent"])
    del times["talker.added"]  # its two segments become one, named after the later milestone
    segments = request_segments(times)
    assert "talker request to its engine thread" not in segments
    assert segments["talker queueing"] == pytest.approx(times["talker.prefill_start"] - times["talker.queued"])
    assert sum(segments.values()) == pytest.approx(times["client.first_audio"] - times["client.sent"])


def test_orchestrator_ids_join_their_client():
    joined = join_client_ids({"abc": {"client.sent": 1.0}, "abc#7": {"session.start": 2.0},
                              "inprocess-1": {"session.start": 3.0}})
    assert joined == {"abc": {"client.sent": 1.0, "session.start": 2.0}, "inprocess-1": {"session.start": 3.0}}


def test_summary_table_has_a_column_per_level():
    times = {name: i * 0.01 for i, (name, _) in enumerate(MILESTONES)}
    rows = [{"system": "server", "concurrency": c, **breakdown.summarize([times, times])} for c in (1, 32)]
    table = breakdown.markdown(rows)
    assert "| segment (p50 ms) | server c1 | server c32 |" in table
    assert "| code2wav first chunk | 10.0 | 10.0 |" in table
    assert rows[0]["total_p50_ms"] == pytest.approx(10.0 * len(SEGMENTS))


def test_starts_at_once_are_their_time_inside_the_window_over_its_length():
    """Three starts (admitted -> first audio): 0-2 s, 1-3 s (its own first audio only at the client), 3-4 s (the
    second's end and its start at the same instant: never counted together); a request without admission is no
    start. Window 0-4 s: 5 s of starts in 4 s, at most two at once."""
    requests = [{"session.start": 0.0, "session.code2wav_first_audio": 2.0, "client.first_audio": 2.1},
                {"session.start": 1.0, "client.first_audio": 3.0},
                {"session.start": 3.0, "session.code2wav_first_audio": 4.0},
                {"client.sent": 0.5, "client.first_audio": 0.9}]
    stats = breakdown.starting_stats(requests, 0.0, 4.0)
    assert stats == {"starting_mean": pytest.approx(5 / 4), "starting_max": 2,
                     "start_mean_ms": pytest.approx(5000 / 3)}
    assert breakdown.starting_stats(requests, 2.0, 4.0)["starting_mean"] == pytest.approx(2 / 2)  # cut to it
    assert breakdown.starting_stats(requests[3:], 0.0, 4.0) == {}
    rows = [{"system": "server", "concurrency": 8, **breakdown.summarize(requests), "starting": stats},
            {"system": "server", "concurrency": 1, **breakdown.summarize(requests)}]
    table = breakdown.markdown(rows)
    assert "| streams starting at once (mean / most; admitted -> first audio) | 1.2 / 2 |  |" in table
    assert "| a start, admitted -> first audio (mean ms) | 1667 |  |" in table
    assert "starting at once" not in breakdown.markdown(rows[1:])


def _assert_ordered_and_complete(events: dict[str, float], first: str, last: str, absent: tuple[str, ...] = ()):
    names = [name for name, _ in MILESTONES]
    expected = [name for name in names[names.index(first):names.index(last) + 1] if name not in absent]
    assert [name for name in names if name in events] == expected
    times = [events[name] for name in expected]
    # The milestones happen in this order (a request's talker can only start after its first thinker chunk...)
    assert times == sorted(times), dict(zip(expected, times))


def test_inprocess_pipeline_records_every_milestone_in_order(tiny_checkpoint, traced):
    from omni_triton.bench.workload import Workload, client_tensors
    from omni_triton.pipeline.inprocess import InProcessPipeline

    workload = Workload(prompt_tokens=4, thinker_tokens=REQUEST["max_tokens"], audio_frames=REQUEST["max_audio_frames"])
    pipeline = InProcessPipeline(tiny_checkpoint)
    try:
        _, audio = pipeline.generate(client_tensors(workload, "hello there"))
    finally:
        pipeline.close()
    assert audio.size
    (events,) = trace.read_events(traced).values()
    # (the talker stage's execute traces its receipt: in-process, the session calls the service itself)
    _assert_ordered_and_complete(events, "session.start", "session.code2wav_first_audio", absent=("talker.received",))


@pytest.mark.server
def test_served_request_records_every_milestone_from_client_to_client(tiny_checkpoint, tmp_path, monkeypatch):
    from server_fixture import start_server

    from omni_triton.client import OmniStreamClient
    from omni_triton.shared.settings import LaunchConfig

    server_trace = tmp_path / "trace" / "server"  # where `bench --trace tmp_path/trace` reads a server's events
    monkeypatch.setenv(trace.TRACE_DIR_ENV, str(server_trace))  # the stubs inherit it
    handle = start_server(LaunchConfig(checkpoint_dir=tiny_checkpoint), tmp_path / "run")
    trace.configure(tmp_path / "client-trace")
    try:
        try:
            with OmniStreamClient(handle.grpc_url) as client:
                result = client.stream("hello there", **REQUEST)
        finally:
            trace.configure(None)
        # then, on the same traced server, the open loop's breakdown (its requests come after this one's end)
        open_loop = _open_loop_report(handle.grpc_url, tiny_checkpoint, tmp_path)
    finally:
        handle.server.stop()
    assert result.ttfa_s is not None
    (client_id,) = trace.read_events(tmp_path / "client-trace")
    request = join_client_ids({**trace.read_events(server_trace),
                               **trace.read_events(tmp_path / "client-trace")})[client_id]
    _assert_ordered_and_complete(request, "client.sent", "client.first_audio")
    segments = request_segments(request)
    # the segments are the client's TTFA, cut where the stages saw the request
    assert sum(segments.values()) == pytest.approx(result.ttfa_s, abs=5e-3)
    # the served engines log their steps into the same trace (each stage's own process)
    steps = [step for step in trace.read_records(server_trace, "step") if step["t"] <= request["client.finished"]]
    assert {step["engine"] for step in steps} == {"thinker", "talker"}
    assert len({step["pid"] for step in steps}) == 2
    talker_frames = sum(step["sampled"] for step in steps if step["engine"] == "talker")
    assert talker_frames == REQUEST["max_audio_frames"] + 1  # frames = talker tokens - 1
    _assert_open_loop_breakdown(*open_loop)


def _open_loop_report(url: str, checkpoint, tmp_path) -> tuple[dict, str]:
    """`bench --request-rate 1 --trace tmp_path/trace` against the server tracing into tmp_path/trace/server: two
    short requests (arrival seed 1) in 2 s; results.json and results.md."""
    from omni_triton.bench.cli import main

    out = tmp_path / "open-loop"
    assert main(["--url", url, "--checkpoint", str(checkpoint), "--quick", "--warmup", "0", "--thinker-tokens", "6",
                 "--audio-frames", "8", "--request-rate", "1", "--duration", "2", "--arrival-seed", "1",
                 "--ttfa-p95-limit-ms", "60000", "--trace", str(tmp_path / "trace"), "--out", str(out)]) == 0
    return json.loads((out / "results.json").read_text()), (out / "results.md").read_text()


def _assert_open_loop_breakdown(report: dict, table: str):
    """The rate's column holds its requests' segments from the client's and the server's traces alike, and the
    engines' and code2wav's rows from the server's records over the rate's window."""
    (rate,), (row,) = report["rates"], report["ttfa_breakdown"]
    assert row["system"] == "server" and row["rate"] == 1.0
    assert row["requests"] == rate["completed"] == rate["sent"] == 2
    assert {"gRPC in, ensemble, preprocess", "thinker prefill + first token", "talker prefill + first frame",
            "code2wav first chunk", "audio to host, response out"} <= set(row["segments"])
    assert set(row["engines"]) == {"thinker", "talker"} and row["code2wav"]["calls"] >= 2
    assert "Where the time to first audio goes" in table and "| segment (p50 ms) | server 1/s |" in table
    assert "| thinker prefill + first token |" in table and "| talker steps: " in table
