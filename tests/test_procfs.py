"""omni_triton.shared.procfs: /proc/<pid>/stat fields as the supervisor, the bench and the server read them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from omni_triton.shared.procfs import PARENT, STATE, SYSTEM_TICKS, USER_TICKS, stat_fields

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_a_live_process_reads_its_state_parent_and_cpu_ticks():
    fields = stat_fields(os.getpid())
    assert fields[STATE] in "RS" and int(fields[PARENT]) == os.getppid()
    assert int(fields[USER_TICKS]) >= 0 and int(fields[SYSTEM_TICKS]) >= 0


def test_a_command_name_with_spaces_and_parentheses_does_not_shift_the_fields(tmp_path):
    binary = tmp_path / "odd) name ("
    shutil.copy(shutil.which("sleep"), binary)
    child = subprocess.Popen([str(binary), "30"])
    try:
        comm = Path(f"/proc/{child.pid}/comm")
        deadline = time.monotonic() + 10
        while comm.read_text().strip() != binary.name:  # exec'd: the odd name is in its stat line now
            assert time.monotonic() < deadline, "the child never took its name"
            time.sleep(0.01)
        fields = stat_fields(child.pid)
        assert fields[STATE] in "RSD" and int(fields[PARENT]) == os.getpid()
    finally:
        child.kill()
        child.wait()


def test_a_gone_process_reads_none():
    child = subprocess.Popen(["true"])
    child.wait()
    assert stat_fields(child.pid) is None
