"""The stage load timeline (omni_triton.load_timeline): the phases it reports and the process age it reads."""

import subprocess
import sys
import time

from omni_triton.load_timeline import LoadTimeline, process_age_s


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
