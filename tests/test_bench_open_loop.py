"""The open loop without a server: the arrival schedule, one rate's run over fake streams, the per-rate row, the
goodput criterion and search, the options and the report."""

from __future__ import annotations

import json
import threading
import time
import uuid

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from omni_triton import trace
from omni_triton.bench import open_loop_report
from omni_triton.bench.cli import parse_args
from omni_triton.bench.goodput import Search, highest_passing, verdict
from omni_triton.bench.metrics import RequestTiming
from omni_triton.bench.open_loop import (ARRIVAL_COUNTS, ARRIVALS_LINE, DRAIN_TIMEOUT_CODE, EXACT, LATE_START_S,
                                         POISSON, RateRun, StreamPool, arrival_times, run_rate, summarize_rate)
from omni_triton.bench.open_loop_cli import request_rates

RATE = 24000


# -- arrival schedule ------------------------------------------------------------------------------

def old_arrival_times(rate: float, duration_s: float, seed: int) -> np.ndarray:
    """arrival_times as it was before `--arrivals` (its formula, copied): the free count that --arrivals poisson
    keeps, so that a run compares with older results."""
    rng = np.random.default_rng(seed)
    expected = rate * duration_s
    gaps = rng.standard_exponential(int(expected + 6 * np.sqrt(expected) + 16))
    while gaps.sum() / rate < duration_s:
        gaps = np.concatenate([gaps, rng.standard_exponential(gaps.size)])
    times = np.cumsum(gaps) / rate
    return times[times < duration_s]


@pytest.mark.parametrize("count", ARRIVAL_COUNTS)
def test_arrivals_are_seeded_sorted_and_inside_the_window(count):
    first = arrival_times(4.0, 30.0, seed=7, count=count)
    assert np.array_equal(first, arrival_times(4.0, 30.0, seed=7, count=count))
    assert not np.array_equal(first, arrival_times(4.0, 30.0, seed=8, count=count))
    assert np.all(np.diff(first) > 0) and first[0] > 0 and first[-1] < 30.0


@pytest.mark.parametrize("rate, duration, count", [
    (14, 20, 280), (16, 20, 320), (18, 20, 360), (4, 30, 120), (1000, 5, 5000), (0.5, 4, 2),
    (2.5, 1, 3), (0.3, 4, 1), (0.1, 4, 1),  # rounded half up, and never none
])
def test_exact_arrivals_offer_the_rate_named(rate, duration, count):
    """N = round(rate x duration) whatever the seed; before (the free count, seed 0, 20 s) 14, 16 and 18/s offered
    249, 280 and 317 arrivals: 12.45, 14.00 and 15.85/s."""
    for seed in (0, 1, 2, 12345):
        times = arrival_times(rate, duration, seed)
        assert times.size == count, (seed, times.size)
        assert np.all(np.diff(times) >= 0) and times[0] >= 0 and times[-1] < duration
    assert [len(arrival_times(rate, 20.0, 0, POISSON)) for rate in (14, 16, 18)] == [249, 280, 317]


def test_exact_arrivals_at_a_higher_rate_are_a_lower_rate_s_and_more():
    """The same seeded uniforms at every rate, more of them at a higher one: no rate's draw luckier than another's."""
    low, high = arrival_times(4.0, 10.0, seed=3), arrival_times(8.0, 10.0, seed=3)
    assert high.size == 2 * low.size and np.isin(low, high).all()


def test_the_free_count_is_the_draw_from_before_the_option():
    for rate, duration, seed in ((16.0, 20.0, 0), (14.0, 20.0, 0), (18.0, 20.0, 0), (4.0, 30.0, 7), (0.5, 4.0, 1),
                                 (1000.0, 5.0, 0)):
        assert np.array_equal(arrival_times(rate, duration, seed, count=POISSON),
                              old_arrival_times(rate, duration, seed)), (rate, duration, seed)


def test_a_higher_rate_plays_the_same_free_count_schedule_faster():
    slow = arrival_times(2.0, 20.0, seed=3, count=POISSON)
    assert np.allclose(arrival_times(4.0, 10.0, seed=3, count=POISSON), slow / 2)


@pytest.mark.parametrize("count", ARRIVAL_COUNTS)
def test_arrivals_are_poisson(count):
    """Counts per second are Poisson (mean = variance = rate), gaps exponential (mean 1/rate, P(gap > mean) =
    1/e), over a long schedule: bounds of several standard errors, so a correct sampler never fails them. The exact
    count is the Poisson process given its count: as bursty, only its total fixed."""
    rate, duration = 20.0, 2000.0
    times = arrival_times(rate, duration, seed=11, count=count)
    expected = rate * duration
    assert abs(times.size - expected) < 5 * np.sqrt(expected)
    if count == EXACT:
        assert times.size == expected
    counts = np.bincount(times.astype(int), minlength=int(duration))
    assert counts.mean() == pytest.approx(rate, rel=0.02)
    assert counts.var() == pytest.approx(rate, rel=0.15)
    gaps = np.diff(times)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.02)
    assert np.mean(gaps > 1 / rate) == pytest.approx(np.exp(-1), abs=0.02)


def test_a_long_free_count_schedule_draws_more_than_its_first_guess():
    assert arrival_times(1000.0, 5.0, seed=0, count=POISSON)[-1] > 4.9


@pytest.mark.parametrize("rate, duration", [(0, 10), (-1, 10), (1, 0)])
def test_arrivals_refuse_a_rate_or_duration_that_is_not_positive(rate, duration):
    with pytest.raises(ValueError, match="must be > 0"):
        arrival_times(rate, duration, seed=0)


def test_arrivals_refuse_an_unknown_count():
    with pytest.raises(ValueError, match="count must be one of exact, poisson, got 'uniform'"):
        arrival_times(1.0, 10.0, seed=0, count="uniform")


# -- one rate over fake streams --------------------------------------------------------------------

class FakeRunner:
    """Streams whose requests end at once, or (``until_cancelled``) only when cancelled; each stream checks that
    no two requests ever run on it at the same time."""

    name, sequential, max_concurrency = "server", False, None

    def __init__(self, until_cancelled: bool = False):
        self.until_cancelled = until_cancelled
        self.opened = []

    def open_worker(self):
        worker = FakeWorker(self.until_cancelled)
        self.opened.append(worker)
        return worker


class FakeWorker:
    def __init__(self, until_cancelled: bool):
        self.until_cancelled, self.busy, self.requests, self.closed = until_cancelled, False, 0, False
        self.cancelled = threading.Event()

    def request(self, tensors) -> RequestTiming:
        assert not self.busy, "two requests on one stream"
        self.busy = True
        self.requests += 1
        if self.until_cancelled:
            self.cancelled.wait(timeout=20)
        self.busy = False
        if self.cancelled.is_set():
            return RequestTiming(error="StreamError: CANCELLED: cancelled", error_code="CANCELLED")
        return RequestTiming(text_times=[0.01], audio_chunks=[(0.02, RATE)], total_s=0.5)

    def cancel(self):
        self.cancelled.set()

    def close(self):
        self.closed = True


def test_every_arrival_is_sent_and_ends_and_streams_are_reused_not_shared():
    runner = FakeRunner()
    pool = StreamPool(runner)
    run = run_rate(pool, {}, np.array([0.0, 0.001, 0.002, 0.05, 0.06]), max_in_flight=10, drain_timeout_s=30)
    assert len(run.timings) == 5 and all(t.ok for t in run.timings)
    assert run.not_started == 0 and run.drained_out == 0 and len(run.start_lags_s) == 5
    assert 1 <= run.peak_in_flight <= 5 and run.wall_s > 0
    assert sum(worker.requests for worker in runner.opened) == 5  # FakeWorker asserts no sharing
    pool.close()
    assert all(worker.closed for worker in runner.opened)


def test_arrivals_past_the_cap_are_not_sent_and_the_drain_timeout_cancels_what_still_runs():
    runner = FakeRunner(until_cancelled=True)
    pool = StreamPool(runner)
    run = run_rate(pool, {}, np.array([0.0, 0.001, 0.002]), max_in_flight=1, drain_timeout_s=0.05)
    assert run.not_started == 2 and run.drained_out == 1 and run.peak_in_flight == 1
    (timing,) = run.timings
    assert timing.error_code == DRAIN_TIMEOUT_CODE and "DRAIN_TIMEOUT" in timing.error
    assert runner.opened[0].cancelled.is_set()
    pool.close()


def test_run_rate_refuses_a_cap_or_timeout_that_cannot_work():
    with pytest.raises(ValueError, match="max_in_flight"):
        run_rate(StreamPool(FakeRunner()), {}, np.array([0.0]), max_in_flight=0, drain_timeout_s=1)


# -- the row of one rate ---------------------------------------------------------------------------

def ok_timing(first_audio: float, gap_after_first: float = 0.0) -> RequestTiming:
    """Two 1 s chunks; the second arrives ``gap_after_first`` s after the first has played out (dry time)."""
    return RequestTiming(text_times=[first_audio / 2],
                         audio_chunks=[(first_audio, RATE), (first_audio + 1.0 + gap_after_first, RATE)],
                         total_s=first_audio + 1.0 + gap_after_first)


def failed_timing(code: str) -> RequestTiming:
    return RequestTiming(error=f"StreamError: {code}: x", error_code=code, total_s=0.1)


def test_rate_row_counts_requests_failures_by_code_and_late_starts():
    timings = [ok_timing(0.1), ok_timing(0.2), ok_timing(0.3, gap_after_first=0.2), failed_timing("UNAVAILABLE"),
               failed_timing("UNAVAILABLE"), failed_timing(DRAIN_TIMEOUT_CODE)]
    lags = [0.0, 0.001, LATE_START_S + 0.01, 0.0, 0.2, 0.0]
    run = RateRun(timings=timings, start_lags_s=lags, not_started=1, drained_out=1, peak_in_flight=4, wall_s=10.0)
    row = summarize_rate("server", 0.6, 10.0, run)
    assert (row.arrivals, row.sent, row.completed, row.not_started) == (7, 6, 3, 1)
    assert row.failed_by_code == {DRAIN_TIMEOUT_CODE: 1, "UNAVAILABLE": 2}
    assert row.late_starts == 2 and row.achieved_rate == pytest.approx(0.6)
    assert row.metrics.ttfa_p50 == pytest.approx(0.2) and row.metrics.ran_dry == 1
    assert row.metrics.requests_per_s == pytest.approx(0.3)  # completed over first sent -> last ended
    assert row.metrics.audio_s_per_s == pytest.approx(0.6) and row.metrics.concurrency == 4
    flat = row.to_dict()
    assert flat["rate"] == 0.6 and flat["ttfa_p95"] == row.metrics.ttfa_p95 and flat["failed"] == 3
    assert flat["passes"] is True and json.loads(json.dumps(flat)) == flat  # verdict not given yet: None


def test_a_rate_that_sent_nothing_is_an_empty_row():
    row = summarize_rate("server", 0.01, 5.0, RateRun([], [], 0, 0, 0, 0.0))
    assert (row.sent, row.completed, row.metrics.requests_per_s, row.metrics.wall_s) == (0, 0, 0.0, 0.0)
    assert verdict(row) == "no request completed"


def test_verdict_passes_only_a_clean_rate_within_the_limit():
    def row(timings, not_started=0):
        return summarize_rate("server", 1.0, 10.0, RateRun(timings, [0.0] * len(timings), not_started, 0, 2, 5.0))

    assert verdict(row([ok_timing(0.1), ok_timing(0.4)])) is None
    assert verdict(row([ok_timing(0.6)])) == "TTFA p95 600 ms > 500 ms"
    assert verdict(row([ok_timing(0.6)]), ttfa_p95_limit_s=0.6) is None
    assert verdict(row([ok_timing(0.1, gap_after_first=0.06)])) == "1 ran dry (> 50 ms)"
    assert verdict(row([ok_timing(0.1), failed_timing("INTERNAL")])) == "1 failed"
    assert verdict(row([ok_timing(0.1)], not_started=3)) == "3 not sent (client in-flight cap)"
    text_only = RequestTiming(text_times=[0.1], total_s=0.2)
    assert verdict(row([text_only])) == "no audio"


# -- goodput ---------------------------------------------------------------------------------------

def test_search_doubles_then_bisects():
    search = Search(start=1, max_rate=256, bisections=3)
    assert search.run(lambda rate: rate <= 5.3) == 5
    assert list(search.tried.items()) == [(1, True), (2, True), (4, True), (8, False), (6, False), (5, True),
                                          (5.5, False)]


def test_search_halves_from_a_failing_start():
    search = Search(start=16, max_rate=256, bisections=2)
    assert search.run(lambda rate: rate <= 5.3) == 5
    assert list(search.tried) == [16, 8, 4, 6, 5]


def test_search_stops_at_its_bounds():
    never = Search(start=1, min_rate=0.25, bisections=3)
    assert never.run(lambda rate: False) is None and list(never.tried) == [1, 0.5, 0.25]
    always = Search(start=1, max_rate=6, bisections=3)
    assert always.run(lambda rate: True) == 6 and list(always.tried) == [1, 2, 4, 6]


@settings(max_examples=200, deadline=None)
@given(threshold=st.floats(0.2, 200), start=st.sampled_from([0.5, 1.0, 3.0, 16.0]), bisections=st.integers(0, 5))
def test_search_finds_a_monotone_threshold_within_its_resolution(threshold, start, bisections):
    """Against a server that passes every rate up to ``threshold``: the goodput never exceeds it, every rate is
    measured once, and the gap left is at most the doubling bracket halved ``bisections`` times."""
    calls = []
    search = Search(start=start, max_rate=256, min_rate=0.125, bisections=bisections)
    goodput = search.run(lambda rate: calls.append(rate) or rate <= threshold)
    assert len(calls) == len(set(calls))
    assert goodput is not None and goodput <= threshold
    assert threshold - goodput <= goodput / 2 ** bisections + 1e-3  # bracket [g, 2g] at worst


def test_search_refuses_bounds_out_of_order():
    with pytest.raises(ValueError, match="min_rate <= start <= max_rate"):
        Search(start=10, max_rate=5)


def test_goodput_of_a_list_is_its_highest_passing_rate():
    assert highest_passing({1: True, 2: True, 4: False, 3: True}) == 3
    assert highest_passing({1: False}) is None


# -- options ---------------------------------------------------------------------------------------

def test_request_rate_parses_a_list_or_auto():
    assert request_rates("1,2.5,8") == (1.0, 2.5, 8.0) and request_rates("auto") == "auto"
    for text in ("0", "1,x", "-2"):
        with pytest.raises(Exception, match="rate|requests/s"):
            request_rates(text)


@pytest.mark.parametrize("extra, message", [
    (["--concurrency", "1,2"], "drop --concurrency"),
    (["--systems", "server,inprocess"], "--systems must be one of"),
    (["--duration", "0"], "--duration must be > 0"),
    (["--goodput-start", "8", "--goodput-max", "4"], "is above --goodput-max"),
    (["--request-rate", "auto", "--stop-after-fail"], "--stop-after-fail goes with a list of rates"),
])
def test_open_loop_refuses_closed_loop_options_and_bad_values(extra, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--request-rate", "1,2"] + extra)
    assert message in capsys.readouterr().err


def test_open_loop_defaults():
    args = parse_args(["--request-rate", "auto"])
    assert args.systems == ["server"] and args.max_inflight == 64 and args.duration == 30.0
    assert parse_args([]).systems == ["server", "server-sequential", "inprocess", "transformers"]
    assert parse_args([]).max_inflight is None


def test_arrivals_default_to_the_exact_count_and_refuse_another_kind(capsys):
    assert parse_args(["--request-rate", "1"]).arrivals == EXACT
    assert parse_args(["--request-rate", "1", "--arrivals", "poisson"]).arrivals == POISSON
    with pytest.raises(SystemExit):
        parse_args(["--request-rate", "1", "--arrivals", "uniform"])
    assert "argument --arrivals: invalid choice: 'uniform'" in capsys.readouterr().err


@pytest.mark.parametrize("count", ARRIVAL_COUNTS)
def test_the_arrivals_flag_reaches_the_schedule_and_the_report(count, tmp_path, monkeypatch):
    from omni_triton.bench import open_loop_cli
    from omni_triton.bench.cli import main

    rate, duration, seed = 16.0, 0.5, 1
    assert len(arrival_times(rate, duration, seed, POISSON)) != len(arrival_times(rate, duration, seed)), \
        "a seed whose free count is not the exact one: the rows tell which the run drew"
    monkeypatch.setattr(open_loop_cli, "TritonStreamRunner", lambda url, sequential: FakeRunner())
    out = tmp_path / "report"
    assert main(["--url", "127.0.0.1:1", "--quick", "--warmup", "0", "--request-rate", f"{rate:g}", "--duration",
                 f"{duration:g}", "--arrival-seed", str(seed), "--arrivals", count, "--out", str(out)]) == 0
    report = json.loads((out / "results.json").read_text())
    assert report["open_loop"]["arrivals"] == count
    [row] = report["rates"]
    scheduled = len(arrival_times(rate, duration, seed, count))
    assert row["arrivals"] == row["sent"] == row["completed"] == scheduled
    if count == EXACT:
        assert scheduled == 8 and row["achieved_rate"] == rate
    text = (out / "results.md").read_text()
    assert f"Arrivals: {ARRIVALS_LINE[count]}." in text
    assert all(line not in text for kind, line in ARRIVALS_LINE.items() if kind != count)


# -- report ----------------------------------------------------------------------------------------

def synthetic_report(tmp_path) -> dict:
    rows = []
    for rate, first_audio, passes in ((1.0, 0.1, True), (2.0, 0.3, True), (4.0, 0.9, False)):
        timings = [ok_timing(first_audio)] * 3 + ([failed_timing("UNAVAILABLE")] if not passes else [])
        row = summarize_rate("server", rate, 3.0, RateRun(timings, [0.0] * len(timings), 0, 0, 3, 3.0))
        row.verdict = verdict(row)
        row.metrics.server_cpu_pct = {"tritonserver": 10.0 * rate, "thinker_0_0": 50.0}
        row.metrics.server_cpu_ms_per_request = {"tritonserver": 4.0, "thinker_0_0": 12.5 * rate}
        rows.append(row)
    return {"label": "synthetic", "command": "omni-triton bench --request-rate 1,2,4", "machine": {"cpu": "x"},
            "workload": {"prompt_tokens": 16, "thinker_tokens": 16, "audio_frames": 25, "warmup_requests": 0},
            "prompt_ids": 30, "notes": ["a note"],
            "open_loop": {"system": "server", "duration_s": 3.0, "arrival_seed": 0, "max_client_streams": 512,
                          "drain_timeout_s": 120.0, "late_start_s": LATE_START_S},
            "goodput": {"system": "server", "requests_per_s": 2.0, "ttfa_p95_limit_s": 0.5,
                        "tried": [(1.0, True), (2.0, True), (4.0, False)], "search": None},
            "rates": [row.to_dict() for row in rows]}


def test_markdown_has_the_goodput_line_and_a_row_per_rate(tmp_path):
    text = open_loop_report.markdown(synthetic_report(tmp_path))
    assert "Goodput: **2 requests/s** (the highest passing rate of the list" in text
    assert "Rates tried: 1 pass, 2 pass, 4 fail." in text
    assert "| server | 1 | 1.00 | 3 | 3 | 0 | 0 | 3 | 50 | 100 | 100 | 100 | 0 | 0 |" in text
    assert "no: 1 failed; TTFA p95 900 ms > 500 ms" in text
    assert "- server @ 4/s: UNAVAILABLE x 1" in text and "a note" in text
    assert "| system | rate | tritonserver | thinker_0_0 |" in text and "| server | 4/s | 40 | 50 |" in text
    assert "CPU per completed request, ms" in text and "| server | 4/s | 4.0 | 50.0 |" in text


def test_the_report_says_which_arrivals_and_a_report_from_before_the_option_had_the_free_count(tmp_path):
    report = synthetic_report(tmp_path)  # no "arrivals": written before --arrivals
    assert f"Arrivals: {ARRIVALS_LINE[POISSON]}." in open_loop_report.markdown(report)
    report["open_loop"]["arrivals"] = EXACT
    text = open_loop_report.markdown(report)
    assert "Arrivals: N = rate x duration (rounded half up, at least 1), uniform times (a Poisson process given its " \
           "count): every rate offers the rate it names." in text and ARRIVALS_LINE[POISSON] not in text


def test_plot_draws_the_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = open_loop_report.plot(synthetic_report(tmp_path), tmp_path)
    assert path == tmp_path / "open_loop.png" and path.stat().st_size > 10_000


def test_goodput_notes_name_a_search_at_its_ceiling_and_failures_below_the_goodput():
    from omni_triton.bench.open_loop_cli import _goodput_notes

    ceiling = _goodput_notes(Search(start=1, max_rate=8), {"requests_per_s": 8, "tried": [(4, True), (8, True)]})
    assert ceiling == ["goodput search stopped at --goodput-max 8: the goodput may be higher"]
    (note,) = _goodput_notes(None, {"requests_per_s": 6, "tried": [(2, True), (4, False), (6, True), (8, False)]})
    assert note.startswith("rates below the goodput failed (4/s)")
    assert _goodput_notes(None, {"requests_per_s": None, "tried": [(2, False)]}) == []


# -- --trace: a TTFA breakdown per rate -----------------------------------------------------------

class TracingRunner(FakeRunner):
    """Streams that trace what a served request traces: the client's milestones in this process, and its
    orchestrator's ``session.start`` as the server would (``<client id>#1``, in the server's own directory)."""

    def __init__(self, server_dir):
        super().__init__()
        self.server_dir = server_dir

    def open_worker(self):
        return TracingWorker(self.server_dir)


class TracingWorker(FakeWorker):
    def __init__(self, server_dir):
        super().__init__(until_cancelled=False)
        self.server_dir = server_dir

    def request(self, tensors) -> RequestTiming:
        request_id = uuid.uuid4().hex
        trace.event(request_id, "client.sent")
        self.server_dir.mkdir(parents=True, exist_ok=True)
        with open(self.server_dir / "4242.jsonl", "a") as server_log:  # the orchestrator's process
            server_log.write(json.dumps({"id": f"{request_id}#1", "event": "session.start",
                                         "t": time.monotonic(), "pid": 4242}) + "\n")
        trace.event(request_id, "client.first_audio")
        trace.event(request_id, "client.finished")
        return super().request(tensors)


def test_trace_gives_each_rate_its_dir_and_a_breakdown_column_in_rate_order(tmp_path, monkeypatch):
    from omni_triton.bench import open_loop_cli
    from omni_triton.bench.cli import main

    trace_dir, out = tmp_path / "trace", tmp_path / "report"
    monkeypatch.setattr(open_loop_cli, "TritonStreamRunner",
                        lambda url, sequential: TracingRunner(trace_dir / "server"))
    # given out of order, as a search tries them; one warm-up request, traced into no rate
    assert main(["--url", "127.0.0.1:1", "--quick", "--warmup", "1", "--request-rate", "8,4", "--duration", "0.5",
                 "--arrival-seed", "3", "--trace", str(trace_dir), "--out", str(out)]) == 0
    assert open_loop_cli.rate_trace_dir(trace_dir, "server", 0.5) == trace_dir / "server-r0.5"
    assert sorted(path.name for path in trace_dir.iterdir()) == ["server", "server-r4", "server-r8"]
    report = json.loads((out / "results.json").read_text())
    sent = {row["rate"]: row["sent"] for row in report["rates"]}
    breakdowns = {row["rate"]: row for row in report["ttfa_breakdown"]}
    assert list(breakdowns) == [8.0, 4.0] and all(row["system"] == "server" for row in breakdowns.values())
    for rate, row in breakdowns.items():
        assert sent[rate] >= 1 and row["requests"] == sent[rate]  # this rate's requests only
        # joined with the server's events: client.sent -> session.start -> client.first_audio
        assert set(row["segments"]) == {"orchestrator admission", "audio to host, response out"}
        assert row["starting"]["starting_max"] >= 1
    text = (out / "results.md").read_text()
    assert "Where the time to first audio goes" in text
    assert "| segment (p50 ms) | server 4/s | server 8/s |" in text
    assert f"| requests | {sent[4.0]} | {sent[8.0]} |" in text


def test_closed_loop_options_are_still_refused_with_trace(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--request-rate", "1", "--trace", "t", "--requests-per-level", "4"])
    assert "drop --requests-per-level" in capsys.readouterr().err
    assert parse_args(["--request-rate", "1", "--trace", "t"]).trace.name == "t"


# -- merging open-loop runs ------------------------------------------------------------------------

def write_run(tmp_path, name: str, keep_rates: set[float], **open_loop) -> str:
    report = synthetic_report(tmp_path)
    report["rates"] = [row for row in report["rates"] if row["rate"] in keep_rates]
    report["goodput"]["tried"] = [(row["rate"], row["passes"]) for row in report["rates"]]
    report["open_loop"].update(open_loop)
    report["command"] += f" --out {name}"
    (tmp_path / name).mkdir()
    (tmp_path / name / "results.json").write_text(json.dumps(report))
    return str(tmp_path / name)


def test_open_loop_runs_merge_into_one_report_with_the_goodput_of_all(tmp_path):
    from omni_triton.bench.cli import main

    high, low = write_run(tmp_path, "high", {4.0}), write_run(tmp_path, "low", {1.0, 2.0})
    out = tmp_path / "merged"
    assert main(["--merge", high, low, "--out", str(out)]) == 1  # rate 4 had a failed request
    report = json.loads((out / "results.json").read_text())
    assert [row["rate"] for row in report["rates"]] == [1.0, 2.0, 4.0]
    assert report["goodput"]["requests_per_s"] == 2.0 and report["goodput"]["tried"] == [[1.0, True], [2.0, True],
                                                                                          [4.0, False]]
    assert [entry["dir"] for entry in report["merged_from"]] == [high, low]
    text = (out / "results.md").read_text()
    assert "Merged from:" in text and f"--out {high}" not in text and "--out high`" in text
    assert "Goodput: **2 requests/s**" in text
    # runs from before --arrivals: their merge says they had the free count
    assert report["open_loop"]["arrivals"] == POISSON and ARRIVALS_LINE[POISSON] in text


def test_open_loop_merge_refuses_a_rate_twice_other_settings_and_closed_loop_runs(tmp_path):
    from omni_triton.bench.merge import MergeError, write_merged

    first = write_run(tmp_path, "a", {1.0, 2.0})
    with pytest.raises(MergeError, match="rate 2/s is in both"):
        write_merged([first, write_run(tmp_path, "b", {2.0})], tmp_path / "out")
    with pytest.raises(MergeError, match="open_loop duration_s"):
        write_merged([first, write_run(tmp_path, "c", {4.0}, duration_s=60.0)], tmp_path / "out")
    with pytest.raises(MergeError, match="open_loop mix"):  # the soak's mix is another workload
        write_merged([first, write_run(tmp_path, "d", {4.0}, mix={"seed": 0})], tmp_path / "out")
    # exact arrivals offered another load than a run from before --arrivals (the free count) at the same rates
    with pytest.raises(MergeError, match="open_loop arrivals: .*'poisson'.*'exact'"):
        write_merged([first, write_run(tmp_path, "e", {4.0}, arrivals=EXACT)], tmp_path / "out")
    write_merged([first, write_run(tmp_path, "f", {4.0}, arrivals=POISSON)], tmp_path / "out")  # the same kind
    closed = tmp_path / "closed"
    closed.mkdir()
    (closed / "results.json").write_text(json.dumps({"results": [], "workload": {}, "machine": {}, "command": "x"}))
    with pytest.raises(MergeError, match="do not merge with closed-loop ones"):
        write_merged([first, str(closed)], tmp_path / "out")


def test_a_stream_that_cannot_be_opened_fails_its_request_only():
    class FlakyRunner(FakeRunner):
        def open_worker(self):
            if not self.opened:
                self.opened.append(None)
                raise ConnectionError("refused")
            return super().open_worker()

    pool = StreamPool(FlakyRunner())
    run = run_rate(pool, {}, np.array([0.0, 0.01, 0.02]), max_in_flight=10, drain_timeout_s=30)
    assert sorted(t.error_code or "ok" for t in run.timings) == ["ConnectionError", "ok", "ok"]
    assert run.not_started == 0 and run.drained_out == 0


def test_a_server_started_for_the_open_loop_admits_max_inflight(tiny_checkpoint):
    from omni_triton.bench.cli import launch_config
    from omni_triton.bench.workload import QUICK, with_overrides

    def admitted(argv: list[str]) -> int:
        args = parse_args(["--start-server", "--checkpoint", str(tiny_checkpoint)] + argv)
        return launch_config(args, with_overrides(QUICK, concurrencies=args.concurrency))[0].max_inflight_requests

    assert admitted(["--request-rate", "1"]) == 64
    assert admitted(["--request-rate", "1", "--max-inflight", "32"]) == 32
    assert admitted(["--concurrency", "1,40"]) == 40 and admitted([]) == 16
