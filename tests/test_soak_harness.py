"""`omni-triton bench --soak` (issue 48's harness) run for real at a tiny scale: a soak with cancels and expiring
deadlines, a burst past the admission limit, and the code2wav stub killed under load, against real tritonservers
(tiny checkpoint); the report's invariants checked; and one rate of the soak's mix on the open loop (`--request-rate
--mix`, its goodput). No timing thresholds: only what must hold however slow the machine. The pure parts (the request
mix, the recovery point, the leak comparison, the thread counts) are checked on their own first.
"""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from omni_triton.bench.open_loop import ARRIVALS_LINE, EXACT, POISSON, RateRun, arrival_times
from omni_triton.bench.soak import _recovered_after, other_errors, thread_counts, unexpected_around_kill
from omni_triton.bench.soak_probes import leaks
from omni_triton.bench.soak_requests import CANCEL, COMPLETE, DEADLINE, RequestMix, SoakTiming, speakers_of


def test_request_mix_is_seeded_and_spans_its_ranges():
    mix = RequestMix(thinker_tokens=(10, 400), audio_frames=(25, 500), cancel_fraction=0.1, deadline_fraction=0.05,
                     seed=7)
    requests = mix.draw(400)
    again = mix.draw(400)
    assert [(r.text, r.thinker_tokens, r.audio_frames, r.fate, r.speaker) for r in requests] == \
        [(r.text, r.thinker_tokens, r.audio_frames, r.fate, r.speaker) for r in again]
    assert all(np.array_equal(a.audio_in, b.audio_in) for a, b in zip(requests, again) if a.audio_in is not None)
    assert mix.draw(5, first_index=3)[0].text == requests[3].text, "a request depends on its index only"
    fates = [r.fate for r in requests]
    assert 20 <= fates.count(CANCEL) <= 60 and 5 <= fates.count(DEADLINE) <= 40, (fates.count(CANCEL),
                                                                                   fates.count(DEADLINE))
    assert all(r.deadline_s == mix.deadline_s and r.thinker_tokens == 400 and r.audio_frames == 500
               for r in requests if r.fate == DEADLINE), "an expiring request asks for the longest output"
    assert all(r.deadline_s is None for r in requests if r.fate != DEADLINE)
    complete = [r for r in requests if r.fate == COMPLETE]
    assert min(r.thinker_tokens for r in complete) < 60 and max(r.thinker_tokens for r in complete) > 350
    assert {r.speaker for r in requests} == set(mix.speakers)
    spoken = [r.audio_in for r in requests if r.audio_in is not None]
    assert 150 < len(spoken) < 250 and all(16000 <= a.size <= 48000 and a.dtype == np.float32 for a in spoken)
    with pytest.raises(ValueError, match="cancel_fraction"):
        replace(mix, cancel_fraction=0.9, deadline_fraction=0.2)


def _timing(sent_at: float, ttfa_s: float | None, error: str | None = None) -> SoakTiming:
    timing = SoakTiming(sent_at=sent_at, error=error, error_code=error)
    if ttfa_s is not None:
        timing.audio_chunks.append((ttfa_s, 1920))
    return timing


def test_recovery_is_the_first_request_from_which_every_ttfa_is_normal():
    after = [_timing(10.5, 3.0), _timing(11.0, 0.2), _timing(12.0, 2.0), _timing(13.0, 0.3), _timing(14.0, 0.2)]
    assert _recovered_after(after, burst_end=10.0, normal_s=0.5) == 3.0
    assert _recovered_after(after + [_timing(15.0, 0.9)], burst_end=10.0, normal_s=0.5) is None
    assert _recovered_after([_timing(10.5, None, "UNAVAILABLE"), _timing(11.0, 0.1)], 10.0, 0.5) == 1.0


def test_a_kill_scenario_checks_every_request_and_keeps_the_other_errors():
    """Before the fix only requests in flight at the kill or sent while the stage was down were checked: an
    INTERNAL just before the kill or after the reload went unseen, and its message was lost."""
    before = replace(_timing(2.0, 0.1, "INTERNAL"), total_s=1.0, error="StreamError: INTERNAL: boom")
    in_flight = replace(_timing(9.0, 0.1, "UNAVAILABLE"), total_s=1.5)
    refused = replace(_timing(11.0, None, "UNAVAILABLE"), total_s=0.01)
    after_reload = replace(_timing(30.0, None, "INTERNAL"), total_s=0.02, error="StreamError: INTERNAL: not ready")
    cancelled = replace(_timing(31.0, 0.1, "CANCELLED"), fate=CANCEL, cancel_sent=True, total_s=0.5)
    stray_cancel = replace(_timing(32.0, 0.1, "CANCELLED"), total_s=0.5)
    ok = replace(_timing(33.0, 0.1), total_s=1.0)
    timings = [after_reload, before, in_flight, refused, cancelled, stray_cancel, ok]
    assert unexpected_around_kill(timings) == [after_reload, before, stray_cancel]
    rows = other_errors(timings, killed_at=10.0)
    assert [(row["sent_s"], row["ended_s"], row["code"]) for row in rows] == [
        (-8.0, -7.0, "INTERNAL"), (20.0, 20.02, "INTERNAL"), (21.0, 21.5, "CANCELLED"), (22.0, 22.5, "CANCELLED")]
    assert rows[1]["error"] == "StreamError: INTERNAL: not ready"
    assert len(other_errors(timings, killed_at=10.0, limit=1)) == 1


def test_leaks_compare_an_idle_server_with_its_start():
    start = {"gauges": {"omni_kv_blocks_free{stage=thinker}": 64.0, "omni_active_requests{stage=talker}": 0.0},
             "processes": {"talker_0_0": {"pid": 5, "threads": 8}, "thinker_0_0": {"pid": 6, "threads": 8}},
             "shm_regions": ["omni1_2_a"]}
    assert leaks(start, start) == []
    end = {"gauges": {"omni_kv_blocks_free{stage=thinker}": 60.0, "omni_active_requests{stage=talker}": 1.0},
           "processes": {"talker_0_0": {"pid": 5, "threads": 9}, "thinker_0_0": {"pid": 7, "threads": 30}},
           "shm_regions": ["omni1_2_a", "omni1_2_b"]}
    found = leaks(start, end)
    assert len(found) == 4 and "omni_active_requests{stage=talker} = 1" in found[0]
    assert any("kv_blocks_free" in line for line in found) and any("omni1_2_b" in line for line in found)
    assert any(line.startswith("talker_0_0: 9 threads") for line in found), "a restarted thinker is not compared"
    assert not any("threads" in line for line in leaks(start, end, thread_reference={"talker_0_0": 9}))


def test_thread_counts_tell_a_pool_filling_from_threads_left_behind():
    """A pool fills to what the load needs in the first half and stays (the idle end at most its most there); a
    process that leaves a thread per request grows on in the second half and ends above it: a leak."""
    def snapshot(pool: int, leaky: int) -> dict:
        return {"processes": {"orchestrator_0_0": {"pid": 5, "threads": pool}, "talker_0_0": {"pid": 6,
                                                                                             "threads": leaky}},
                "gauges": {}, "shm_regions": []}

    # (t, orchestrator threads: base 9, a pool of up to 8 and 3 per request in flight; talker: one more per 10 s)
    samples = [{"t": t, **snapshot(9 + min(8, t // 5) + 3 * (t % 3), 8 + t // 10)} for t in range(0, 121, 10)]
    counts = thread_counts(snapshot(10, 8), samples, snapshot(17, 21), half_s=60)
    assert counts["orchestrator_0_0"] == {"start": 10, "first_half_most": 23, "second_half_most": 23, "end": 17}
    assert counts["talker_0_0"] == {"start": 8, "first_half_most": 14, "second_half_most": 20, "end": 21}
    left = leaks(snapshot(10, 8), snapshot(17, 21), {name: row["first_half_most"] for name, row in counts.items()})
    assert left == ["talker_0_0: 21 threads, 14 earlier in the run"]


@pytest.mark.parametrize("count", [EXACT, POISSON])
def test_each_phase_offers_its_rate_and_the_report_says_how(count, monkeypatch):
    """A burst's phases (1/s for 2 s, 20/s for 1 s, 1/s for 2 s): exact arrivals, 2 + 20 + 2 of them, each phase's
    in its own window and drawn with its own seed; --arrivals poisson, the free count of before."""
    from omni_triton.bench import soak, soak_report

    sent = {}

    def run_rate(pool, requests, arrivals, **_):
        sent["arrivals"] = arrivals
        return RateRun([], [], 0, 0, 0, 0.0)

    monkeypatch.setattr(soak, "run_rate", run_rate)
    mix = RequestMix(thinker_tokens=(4, 16), audio_frames=(40, 60), seed=0)
    load = soak.LoadSettings(url="127.0.0.1:1", mix=mix, seed=5, arrivals=count)
    phases = [("before", 1.0, 2.0), ("burst", 20.0, 1.0), ("after", 1.0, 2.0)]
    _, phase_of, _ = soak.run_phases(load, phases)
    expected = [arrival_times(rate, seconds, 5 + number, count) + start for number, ((_, rate, seconds), start)
                in enumerate(zip(phases, (0.0, 2.0, 3.0)))]
    assert np.array_equal(sent["arrivals"], np.concatenate(expected))
    assert phase_of == [name for (name, *_), times in zip(phases, expected) for _ in times]
    if count == EXACT:
        assert [phase_of.count(name) for name, *_ in phases] == [2, 20, 2]
    report = {"label": "x", "command": "omni-triton bench --soak burst", "machine": {}, "scenarios": {},
              "settings": {"goodput": 5.0, "rates": {"burst": 20.0}, "mix": mix.describe(), "arrivals": count}}
    assert f"Arrivals: {ARRIVALS_LINE[count]}." in soak_report.markdown(report)
    del report["settings"]["arrivals"]  # a report from before --arrivals: the free count
    assert f"Arrivals: {ARRIVALS_LINE[POISSON]}." in soak_report.markdown(report)


def test_mix_goes_with_the_open_loop_of_one_streaming_server(capsys):
    from omni_triton.bench.cli import parse_args

    for argv, message in ((["--mix"], "--mix goes with --request-rate"),
                          (["--request-rate", "1", "--mix", "--systems", "server-sequential"], "--systems must be"),
                          (["--request-rate", "auto", "--mix", "--cancel-fraction", "0.99"], "cancel_fraction")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert message in capsys.readouterr().err, argv
    assert parse_args(["--request-rate", "auto", "--mix", "--mix-thinker-tokens", "4-16"]).mix


@pytest.mark.server
def test_open_loop_goodput_of_the_soaks_mix(triton_server, tiny_checkpoint, tmp_path):
    """`bench --request-rate R --mix`: the soak's requests (its mix options, its seed) on the open loop; the ones
    the client cancelled and the expired ones end so and are not failures: the rate's verdict is the soak's load's.
    Before: the open loop had only the fixed workload (whose goodput overloaded the server with the mix)."""
    from omni_triton.bench.cli import main

    rate, duration_s, seed = 2.0, 4.0, 0
    options = dict(thinker_tokens=(4, 16), audio_frames=(30, 50), cancel_fraction=0.3, deadline_fraction=0.3,
                   deadline_s=0.3, seed=seed)
    out = tmp_path / "goodput-mix"
    # a generous TTFA limit: on a shared CPU the verdict's TTFA depends on the machine, the failures must not
    status = main(["--url", triton_server.grpc_url, "--checkpoint", str(tiny_checkpoint), "--warmup", "1",
                   "--request-rate", str(rate), "--mix", "--duration", str(duration_s), "--arrival-seed", str(seed),
                   "--ttfa-p95-limit-ms", "60000", "--mix-thinker-tokens", "4-16", "--mix-audio-frames", "30-50",
                   "--cancel-fraction", "0.3", "--deadline-fraction", "0.3", "--deadline-s", "0.3",
                   "--out", str(out)])
    report = json.loads((out / "results.json").read_text())
    mix = RequestMix(**options, speakers=speakers_of(tiny_checkpoint))
    assert report["open_loop"]["mix"] == json.loads(json.dumps(mix.describe()))
    [row] = report["rates"]
    scheduled = mix.draw(len(arrival_times(rate, duration_s, seed)))
    meant_to_fail = sum(request.fate != COMPLETE for request in scheduled)
    assert meant_to_fail >= 2 and row["sent"] == len(scheduled), "seed 0 draws cancels and deadlines"
    assert status == 0 and row["failed_by_code"] == {} and "failed" not in (row["verdict"] or ""), row
    assert 1 <= row["ended_as_meant"] <= meant_to_fail and row["completed"] + row["ended_as_meant"] == row["sent"]
    assert (30 - 1) / 12.5 < row["audio_s_per_request"] <= 50 / 12.5, "the mix's lengths, not the fixed workload's"
    table = (out / "results.md").read_text()
    assert "Workload: the soak's request mix" in table and "Ended as meant" in table
    assert "cancelled or expired as meant excepted" in table


@pytest.mark.server
def test_soak_burst_and_killed_code2wav_hold_their_invariants(tiny_checkpoint, tmp_path, monkeypatch):
    from omni_triton.bench.cli import main

    monkeypatch.chdir(tmp_path)  # the servers' rendered repositories and logs go under build/
    out = tmp_path / "report"
    status = main(["--start-server", "--checkpoint", str(tiny_checkpoint), "--kv-cache-tokens", "2048",
                   "--max-inflight", "8", "--warmup", "1",
                   "--soak", "soak,burst,kill", "--kill-stages", "code2wav", "--goodput", "1",
                   # the soak: 8 requests (seed 0: 2 to cancel, 2 to expire) over 8 s: room for all 8 at once
                   # (--max-inflight 8), so none is refused however slowly a loaded machine serves them (with 4, a
                   # busy CI machine had 4 streaming when the fifth came, and it was refused); two TTFA windows
                   # (the drift between them)
                   "--soak-load", "1", "--soak-duration", "8", "--ttfa-window", "3", "--sample-every", "0.5",
                   # the burst: some 20 arrivals within a second against 8 places (running and waiting together)
                   "--burst-load", "20", "--burst-seconds", "1", "--burst-around", "2", "2",
                   # killed once code2wav holds a stream 1 s in (back some 4 s later: the last arrivals are served)
                   "--kill-load", "1", "--kill-after", "1", "--kill-duration", "6",
                   "--mix-thinker-tokens", "4-16", "--mix-audio-frames", "40-60", "--cancel-fraction", "0.3",
                   "--deadline-fraction", "0.3", "--deadline-s", "0.3", "--arrival-seed", "0", "--out", str(out)])
    report = json.loads((out / "results.json").read_text())
    failed = [(name, row) for name, result in report["scenarios"].items() if name != "kill"
              for row in result["checks"] if row["kind"] == "invariant" and not row["ok"]]
    failed += [(row["stage"], check) for row in report["scenarios"]["kill"] for check in row["checks"]
               if check["kind"] == "invariant" and not check["ok"]]
    assert status == 0 and not failed and not report["partial"], failed
    assert (out / "results.md").read_text().startswith("# omni-triton soak") and (out / "soak.png").is_file()
    assert report["settings"]["arrivals"] == EXACT and f"Arrivals: {ARRIVALS_LINE[EXACT]}." in \
        (out / "results.md").read_text()

    soak = report["scenarios"]["soak"]
    assert soak["requests"] == 8, "1/s for 8 s: exactly 8 arrivals"
    codes = soak["errors_by_fate_and_code"]
    assert set(codes.get(COMPLETE, {})) <= {"ok"}, codes
    assert set(codes[CANCEL]) <= {"ok", "CANCELLED"} and codes[CANCEL].get("CANCELLED"), codes
    assert set(codes[DEADLINE]) == {"DEADLINE_EXCEEDED"}, codes
    assert soak["leaks"] == [] and soak["idle_after_s"] is not None
    assert soak["ttfa_windows"] and len(soak["samples"]) >= 3
    assert set(soak["threads"]) == set(soak["start"]["processes"]), soak["threads"]
    assert "Threads per process, idle at the start -> the most in the soak's first half" in \
        (out / "results.md").read_text()
    for name in ("tritonserver", "thinker_0_0", "talker_0_0", "code2wav_0_0", "orchestrator_0_0"):
        assert soak["start"]["processes"][name]["rss_mib"] > 0 and name in soak["memory"], name
    assert soak["start"]["shm_regions"], "the server's shared-memory regions are found"
    assert any(key.startswith("omni_code2wav_streams") for key in soak["end"]["gauges"])

    burst = report["scenarios"]["burst"]
    assert burst["refused"] >= 1, burst
    assert all("admission_queue" in message for message in burst["refusal_messages"]), burst
    assert burst["admitted"] + burst["refused"] == sum(burst["requests"].values())

    [kill] = report["scenarios"]["kill"]
    assert kill["stage"] == "code2wav" and kill["back_s"] is not None and kill["served_s"] >= kill["back_s"]
    assert set(kill["errors_by_fate_and_code"][COMPLETE]) <= {"ok", "UNAVAILABLE"}, kill
    assert kill["other_errors"] == [] and kill["other_error_count"] == 0, kill["other_errors"]
    assert any("code2wav stage reloaded" in line for line in kill["reload_log"]), kill["reload_log"]
    # the supervisor's reload line read as seconds after the kill, its steps in order, the report saying them
    steps, rounded = kill["reload_steps"], 0.01  # the line's times are rounded to 10 ms
    assert steps["stage"] == "code2wav" and -rounded <= steps["death_seen_s"] <= steps["load_sent_s"] \
        <= steps["loaded_s"] <= kill["served_s"] + rounded, steps
    assert f"Triton had the stage loaded {steps['loaded_s']}" in (out / "results.md").read_text()
    # the stage's load timeline, at the server's start and at the reload
    assert len(kill["load_log"]) == 2 and all("process was up" in line for line in kill["load_log"]), kill["load_log"]
