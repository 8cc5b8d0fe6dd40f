"""The stage load timeline (omni_triton.load_timeline): the phases it reports and the process age it reads, and the
stage supervisor's reload line with its reading as seconds after a kill."""

import subprocess
import sys
import time

from omni_triton.load_timeline import LoadTimeline, process_age_s, reload_line, reload_steps


def test_process_age_of_a_fresh_process_is_below_ours():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.2)
        ours, theirs = process_age_s(), process_age_s(child.pid)
        assert theirs is not None and ours is not None
        assert 0.0 <= theirs < ours
    finally:
        child.kill()
        child.wait()


def test_process_age_of_a_missing_process_is_none():
    assert process_age_s(2**22 + 12345) is None


def test_the_line_names_each_phase_in_order_and_their_sum():
    lines = []
    timeline = LoadTimeline("thinker", log=lines.append)
    timeline.mark("weights")
    time.sleep(0.05)
    timeline.mark("engine")
    timeline.report()
    (line,) = lines
    assert line.startswith("thinker: loaded in ")
    assert line.index("weights") < line.index("engine")
    assert [phase for phase, _ in timeline.phases] == ["weights", "engine"]
    assert timeline.phases[1][1] >= 0.05
    assert abs(sum(seconds for _, seconds in timeline.phases) - timeline.total_s) < 1e-9
    assert "the process was up" in line


def test_a_reload_line_reads_back_as_its_steps_after_the_kill():
    line = reload_line("talker_p1", seen_dead_at=1000.25, alive_before_s=0.1, sent_after_s=0.5, load_s=3.0)
    assert line.startswith("talker_p1 stage reloaded in 3.5 s: ")
    # in the server log the line may come after other text (a logger's prefix)
    assert reload_steps(f"W stage_supervisor: {line}", killed_at=1000.0) == {
        "stage": "talker_p1", "death_seen_s": 0.25, "load_sent_s": 0.75, "loaded_s": 3.75}
    never_alive = reload_line("code2wav", seen_dead_at=1000.25, alive_before_s=None, sent_after_s=0.0, load_s=1.0)
    assert "alive at the look" not in never_alive
    assert reload_steps(never_alive, killed_at=1000.0)["loaded_s"] == 1.25


def test_other_lines_are_no_reload_steps():
    for line in ("talker stage: its stub process exited; reloading it", "talker stage reloaded in 2.0 s",
                 "talker: loaded in 1.2 s (weights 1.2 s); the process was up 1.8 s before (its start, imports)"):
        assert reload_steps(line, killed_at=0.0) is None, line
