"""Benchmark logic without a server: metrics, the closed-loop driver, workload tensors, perf_analyzer exports,
report rendering."""

from __future__ import annotations

from dataclasses import replace

import json
import threading
import time

import numpy as np
import pytest

from omni_triton.bench.driver import run_level
from hypothesis import given
from hypothesis import strategies as st

from omni_triton.bench.metrics import (RequestTiming, audio_seconds, dry_time, gapless_start_delay, ratios_to, rtf,
                                       summarize, ttfa, ttft, underruns)
from omni_triton.bench.perf_analyzer import export_span_s, perf_analyzer_command, request_records
from omni_triton.bench.report import markdown, plot
from omni_triton.bench.runners import SharedWorker
from omni_triton.bench.workload import QUICK, Workload, client_tensors, prompt_text

RATE = 24000


def timing(text_times=(), chunks=(), total=1.0, error=None) -> RequestTiming:
    return RequestTiming(list(text_times), [(t, int(seconds * RATE)) for t, seconds in chunks], total, error)


# -- per-request metrics ---------------------------------------------------------------------------

def test_first_text_and_first_audio_are_the_first_arrivals():
    t = timing(text_times=[0.05, 0.2], chunks=[(0.3, 0.5), (0.6, 1.0)], total=2.0)
    assert ttft(t) == 0.05 and ttfa(t) == 0.3
    assert audio_seconds(t, RATE) == pytest.approx(1.5)
    assert rtf(t, RATE) == pytest.approx(2.0 / 1.5)


def test_no_audio_means_no_ttfa_and_no_rtf():
    t = timing(text_times=[0.1], total=0.4)
    assert ttfa(t) is None and rtf(t) is None and ttft(timing()) is None


@pytest.mark.parametrize("chunks, expected", [
    ([(1.0, 0.5), (1.5, 0.5), (1.9, 1.0)], 0),   # each chunk arrives by the time the audio before it has played
    ([(1.0, 0.5), (1.6, 0.5)], 1),               # 0.1 s of silence before the second chunk
    ([(1.0, 0.2), (1.5, 0.2), (1.6, 1.0)], 1),   # late once; playback restarts at 1.5 and then keeps up
    ([(1.0, 0.2), (1.5, 0.2), (2.0, 1.0)], 2),
    ([(3.0, 0.1)], 0),                           # a late *first* chunk is TTFA, not an underrun
    ([], 0),
])
def test_underruns_count_chunks_that_arrive_after_playback_ran_dry(chunks, expected):
    assert underruns([(t, int(s * RATE)) for t, s in chunks], RATE) == expected


@pytest.mark.parametrize("chunks, expected", [
    ([(1.0, 0.5), (1.5, 0.5), (1.9, 1.0)], 0.0),   # every chunk in time
    ([(1.0, 0.5), (1.6, 0.5)], 0.1),              # 0.1 s of silence before the second chunk
    ([(1.0, 0.2), (1.5, 0.2), (1.6, 1.0)], 0.3),  # one gap of 0.3 s; the burst after it does not add any
    ([(1.0, 0.2), (1.5, 0.2), (2.0, 1.0)], 0.6),  # two gaps of 0.3 s
    ([(1.0, 2.0), (1.5, 0.1), (2.9, 0.1)], 0.0),  # a big first chunk covers late small ones
    ([(3.0, 0.1)], 0.0),                          # a late first chunk is TTFA, not dry time
    ([], 0.0),
])
def test_dry_time_is_the_silence_after_the_first_chunk(chunks, expected):
    assert dry_time([(t, int(s * RATE)) for t, s in chunks], RATE) == pytest.approx(expected)


def test_gapless_start_delay_is_ttfa_plus_dry_time():
    assert gapless_start_delay(timing(chunks=[(1.0, 0.2), (1.5, 0.2), (2.0, 1.0)]), RATE) == pytest.approx(1.6)
    assert gapless_start_delay(timing(text_times=[0.1]), RATE) is None


def _pause_and_resume_silence(chunks: list[tuple[float, int]]) -> float:
    """A player that starts at the first chunk, plays at real time and waits whenever it has nothing."""
    played_until, silent = chunks[0][0], 0.0
    for arrival, samples in chunks:
        if arrival > played_until:
            silent += arrival - played_until
            played_until = arrival
        played_until += samples / RATE
    return silent


chunk_timelines = st.lists(st.tuples(st.floats(0.0, 2.0), st.integers(1, 2 * RATE)), min_size=1, max_size=30).map(
    lambda gaps: [(sum(g for g, _ in gaps[:i + 1]), samples) for i, (_, samples) in enumerate(gaps)])


@given(chunk_timelines)
def test_dry_time_is_the_silence_heard_and_the_least_buffer_for_gapless_play(chunks):
    dry = dry_time(chunks, RATE)
    assert dry == pytest.approx(_pause_and_resume_silence(chunks), abs=1e-9)
    start = chunks[0][0]

    def gaps_when_starting_at(play_start: float) -> bool:
        played = 0
        for arrival, samples in chunks:
            if arrival > play_start + played / RATE + 1e-9:
                return True
            played += samples
        return False

    assert not gaps_when_starting_at(start + dry)
    if dry > 1e-6:
        assert gaps_when_starting_at(start + dry - 1e-6)
    assert (underruns(chunks, RATE) == 0) == (dry == 0)


# -- one level ---------------------------------------------------------------------------------------

def test_summarize_percentiles_throughput_and_continuity():
    timings = [timing([0.01 * (i + 1)], [(0.1 * (i + 1), 1.0), (0.1 * (i + 1) + 2.0, 1.0)], total=4.0)
               for i in range(4)]  # the second chunk of each is 1 s late
    timings[0].audio_chunks[1] = (timings[0].audio_chunks[0][0] + 0.5, RATE)  # this one in time
    timings.append(timing(error="boom"))
    s = summarize("server", 2, timings, wall_s=8.0, sample_rate=RATE)
    assert (s.requests, s.failed, s.errors) == (5, 1, ["boom"])
    assert s.ttfa_p50 == pytest.approx(np.percentile([0.1, 0.2, 0.3, 0.4], 50))
    assert s.ttft_p99 == pytest.approx(np.percentile([0.01, 0.02, 0.03, 0.04], 99))
    assert s.rtf_mean == pytest.approx(4.0 / 2.0)
    assert s.requests_per_s == pytest.approx(4 / 8.0)
    assert s.audio_s_per_s == pytest.approx(4 * 2.0 / 8.0) and s.audio_s_per_request == pytest.approx(2.0)
    assert s.continuity == pytest.approx(1 / 4)
    # three streams ran dry for 1 s (their second chunk came 2 s after a 1 s first chunk), one did not
    assert (s.ran_dry, s.ran_dry_fraction) == (3, pytest.approx(3 / 4))
    assert s.dry_p50 == pytest.approx(1.0) and s.dry_p95 == pytest.approx(1.0)
    gapless = [0.1, 1.2, 1.3, 1.4]  # TTFA + dry time
    assert s.gapless_start_p50 == pytest.approx(np.percentile(gapless, 50))
    assert s.gapless_start_p95 == pytest.approx(np.percentile(gapless, 95))


def test_a_stream_runs_dry_only_past_50_ms():
    timings = [timing(chunks=[(0.1, 0.5), (0.1 + 0.5 + late, 0.5)]) for late in (0.0, 0.049, 0.051, 0.3)]
    s = summarize("server", 4, timings, wall_s=1.0, sample_rate=RATE)
    assert (s.ran_dry, s.ran_dry_fraction) == (2, 0.5)


def test_summarize_with_every_request_failed_has_no_latencies():
    s = summarize("server", 1, [timing(error="down")] * 2, wall_s=1.0)
    assert s.failed == 2 and s.ttfa_p50 is None and s.continuity is None and s.requests_per_s == 0
    assert s.ran_dry is None and s.dry_p50 is None and s.gapless_start_p50 is None


def test_summarize_rejects_a_zero_wall_time():
    with pytest.raises(ValueError, match="wall_s"):
        summarize("server", 1, [], wall_s=0.0)


def test_ratios_divide_by_the_reference_at_the_same_concurrency():
    ref = summarize("server", 1, [timing([0.1], [(0.2, 2.0)], total=1.0)], wall_s=1.0, sample_rate=RATE)
    other = summarize("inprocess", 1, [timing([0.1], [(0.3, 2.0)], total=1.0)], wall_s=2.0, sample_rate=RATE)
    lone = summarize("inprocess", 8, [timing([0.1], [(0.3, 2.0)], total=1.0)], wall_s=2.0, sample_rate=RATE)
    rows = ratios_to("server", [ref, other, lone])
    assert len(rows) == 1  # no reference at concurrency 8
    assert rows[0]["ttfa_p50"] == pytest.approx(1.5)
    assert rows[0]["audio_s_per_s"] == pytest.approx(0.5)


# -- driver -------------------------------------------------------------------------------------------

class CountingRunner:
    """Records how many requests were in flight at once."""
    name, sequential, max_concurrency = "fake", False, None

    def __init__(self):
        self.lock = threading.Lock()
        self.in_flight = self.most_in_flight = self.sent = 0

    def open_worker(self):
        return SharedWorker(self.request)

    def request(self, tensors):
        with self.lock:
            self.in_flight += 1
            self.sent += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        time.sleep(0.02)
        with self.lock:
            self.in_flight -= 1
        return timing([0.01], [(0.02, 0.1)], total=0.02)

    def close(self):
        pass


@pytest.mark.parametrize("concurrency, requests", [(1, 3), (3, 7), (4, 2)])
def test_run_level_sends_exactly_the_requests_at_most_concurrency_at_once(concurrency, requests):
    runner = CountingRunner()
    done = []
    timings, wall_s = run_level(runner, {}, concurrency, requests, on_done=done.append)
    assert runner.sent == len(timings) == len(done) == requests
    assert runner.most_in_flight == min(concurrency, requests)
    assert wall_s >= 0.02 * -(-requests // concurrency) * 0.9


def test_run_level_rejects_zero_concurrency():
    with pytest.raises(ValueError, match="concurrency"):
        run_level(CountingRunner(), {}, 0, 1)


# -- workload -----------------------------------------------------------------------------------------

def test_client_tensors_pin_every_length():
    tensors = client_tensors(QUICK, "hi", sequential=True)
    assert tensors["TEXT"][0] == b"hi"
    assert tensors["MIN_TOKENS"][0] == tensors["MAX_TOKENS"][0] == QUICK.thinker_tokens
    assert tensors["MIN_AUDIO_FRAMES"][0] == tensors["MAX_AUDIO_FRAMES"][0] == QUICK.audio_frames
    assert bool(tensors["IGNORE_EOS"][0]) and bool(tensors["SEQUENTIAL"][0]) and tensors["TEMPERATURE"][0] == 0
    assert tensors["MAX_TOKENS"].dtype == np.int32 and tensors["SEED"].dtype == np.int64


def test_workload_validation_and_requests_per_level():
    with pytest.raises(ValueError, match="audio_frames"):
        Workload(audio_frames=0)
    with pytest.raises(ValueError, match="concurrencies"):
        Workload(concurrencies=(0,))
    assert Workload().requests_at(1) == 4 and Workload().requests_at(16) == 32
    assert Workload(requests_per_level=3).requests_at(16) == 3


def test_prompt_text_fits_the_token_budget(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    # A character-level tokenizer: every letter is one token, so words cost very different amounts.
    vocab = {c: i for i, c in enumerate(" abcdefghijklmnopqrstuvwxyz")} | {"[UNK]": 27}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    for budget in (5, 40, 100):
        text = prompt_text(budget, tmp_path / "tokenizer.json")
        count = len(tokenizer.encode(text, add_special_tokens=False).ids)
        next_word = prompt_text(budget + 40, tmp_path / "tokenizer.json").split()[len(text.split())]
        assert count <= budget or len(text.split()) == 1
        assert count + 1 + len(next_word) > budget  # the next word would not have fit
    assert len(prompt_text(7).split()) == 7


# -- perf_analyzer exports ------------------------------------------------------------------------------

def export(requests) -> dict:
    return {"experiments": [{"experiment": {"mode": "concurrency", "value": 1}, "requests": requests}]}


def test_profile_export_ttfa_is_the_first_response_with_audio_samples():
    ms = 1_000_000
    request = {"timestamp": str(1000 * ms),
               "response_timestamps": [str((1000 + d) * ms) for d in (10, 20, 50, 90)],
               # empty AUDIO is exported as a bare number, real chunks as lists
               "response_outputs": [{"TEXT_DELTA": "", "AUDIO": 0.0}, {"TEXT_DELTA": "hi", "AUDIO": -1.7e36},
                                    {"TEXT_DELTA": "", "AUDIO": [0.1, 0.2]}, {"TEXT_DELTA": "", "AUDIO": [0.3]}]}
    (record,), source = request_records(export([request]))
    assert source == "AUDIO outputs"
    assert record.ttft_s == pytest.approx(0.020) and record.ttfa_s == pytest.approx(0.050)
    assert record.latency_first_s == pytest.approx(0.010) and record.latency_last_s == pytest.approx(0.090)
    assert record.responses == 4
    assert export_span_s(export([request])) == pytest.approx(0.090)


def test_profile_export_without_outputs_takes_the_nth_response():
    request = {"timestamp": "0", "response_timestamps": ["1000000", "3000000", "7000000"]}
    (record,), source = request_records(export([request]), audio_response=3)
    assert source == "response #3" and record.ttfa_s == pytest.approx(0.007)


def test_perf_analyzer_command_takes_one_load_kind(tmp_path):
    command = perf_analyzer_command(tmp_path / "pa", "omni", "h:1", tmp_path / "in.json", tmp_path / "out.json",
                                    concurrency=4, requests=8)
    assert command[command.index("--concurrency-range") + 1] == "4" and "--streaming" in command
    assert command[command.index("--request-count") + 1] == "8"
    with pytest.raises(ValueError, match="exactly one"):
        perf_analyzer_command(tmp_path / "pa", "omni", "h:1", tmp_path, tmp_path, concurrency=1, request_rate=1.0)


# -- report -----------------------------------------------------------------------------------------------

def test_markdown_and_plots(tmp_path):
    summaries = [summarize(system, c, [timing([0.01 * c], [(0.1 * c, 0.5), (0.1 * c + 0.5 + 0.1 * c, 1.5)],
                                              total=1.0)], wall_s=1.0)
                 for system in ("server", "inprocess") for c in (1, 2)]
    report = {"label": "t", "command": "omni-triton bench --quick", "machine": {"cores": 2},
              "workload": QUICK.__dict__, "prompt_ids": 24, "notes": ["a note"]}
    table = markdown(report, summaries, ratios_to("server", summaries), "server")
    rows = [line for line in table.splitlines() if line.startswith("| server |") or line.startswith("| inprocess |")]
    assert len(rows) == 4 + 4 + 2  # 4 result rows, 4 listener rows, 2 ratio rows
    assert "| server | 2 | 1 | 0 | 20 | 200 |" in table and "a note" in table
    # concurrency 2: 200 ms of silence after the first chunk, so a gapless start at 200 + 200 ms; it ran dry
    assert "| server | 2 | 200 | 200 | 400 | 400 | 1 | 100 |" in table
    # GPU memory: the sum, and each GPU's after it when the stages used several
    one_gpu = replace(summaries[0], gpu_memory_peak_gib=70.06, gpu_memory_peak_gib_per_gpu=[70.06])
    two_gpus = replace(summaries[1], gpu_memory_peak_gib=112.3, gpu_memory_peak_gib_per_gpu=[70.06, 42.24])
    table = markdown(report, [one_gpu, two_gpus], [], "server")
    rows = [line for line in table.splitlines() if line.startswith("| server |")][:2]  # the result rows
    assert rows[0].endswith(" | 70.1 |") and rows[1].endswith(" | 112.3 (70.1 + 42.2) |"), rows
    json.dumps(report)
    pytest.importorskip("matplotlib")
    paths = plot(summaries, tmp_path)
    assert sorted(p.name for p in paths) == ["gapless_start.png", "ran_dry.png", "throughput.png", "ttfa.png"]
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in paths)


def test_gpu_memory_peak_keeps_the_most_in_use(monkeypatch):
    from omni_triton.bench import gpu_memory

    readings = iter([[1000], [5000], [3000]] + [[2000]] * 100)
    monkeypatch.setattr(gpu_memory, "gpu_memory_used_mib", lambda: next(readings))
    with gpu_memory.GpuMemoryPeak(interval_s=0.01) as peak:
        time.sleep(0.1)
    assert peak.peak_mib == 5000 and peak.gib == pytest.approx(4.88) and peak.gib_per_gpu == [4.88]
    # two GPUs: each one's peak, whenever it came, and the peak of the sum (not the sum of the peaks)
    readings = iter([[1024, 4096], [3072, 1024]] + [[2048, 2048]] * 100)
    monkeypatch.setattr(gpu_memory, "gpu_memory_used_mib", lambda: next(readings))
    with gpu_memory.GpuMemoryPeak(interval_s=0.01) as peak:
        time.sleep(0.1)
    assert peak.gib_per_gpu == [3.0, 4.0] and peak.gib == 5.0
    monkeypatch.setattr(gpu_memory, "gpu_memory_used_mib", lambda: None)  # no GPU: nothing measured
    with gpu_memory.GpuMemoryPeak() as peak:
        pass
    assert peak.gib is None
