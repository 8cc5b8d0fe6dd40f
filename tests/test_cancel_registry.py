"""The cancel registry the orchestrator instances of one server share (serve --pipelines): a cancel recorded by one
instance is taken by the one that holds the request, once, only for requests that had arrived by then, and nothing
stays behind."""

from __future__ import annotations

import os

from omni_triton.shared.cancel_registry import CancelRegistry, registry_dir, remove_registry


def test_a_cancel_reaches_the_instance_holding_the_request_once(tmp_path):
    recorder, holder = CancelRegistry(tmp_path / "cancels"), CancelRegistry(tmp_path / "cancels")
    recorder.record("client/1", at=100.0)  # any id: slashes, length
    assert holder.take({"other": 50.0}, now=100.1) == {}  # not held here: stays for its holder
    assert holder.take({"client/1": 99.0, "other": 50.0}, now=100.1) == {"client/1": 100.0}
    assert holder.take({"client/1": 99.0}, now=100.2) == {}  # used: removed
    assert os.listdir(tmp_path / "cancels") == []


def test_a_cancel_never_applies_to_a_request_of_that_id_arriving_after_it(tmp_path):
    registry = CancelRegistry(tmp_path)
    registry.record("reused", at=100.0)
    assert registry.take({"reused": 100.5}, now=100.6) == {}
    registry.record("reused", at=101.0)  # a later cancel of the same id replaces the entry
    assert registry.take({"reused": 100.5}, now=101.1) == {"reused": 101.0}


def test_cancels_nobody_holds_expire_and_the_last_instance_removes_the_directory(tmp_path):
    registry = CancelRegistry(tmp_path / "cancels", ttl_s=5.0)
    registry.record("ended already", at=100.0)
    registry.take({}, now=104.0)
    assert len(os.listdir(tmp_path / "cancels")) == 1  # not expired yet
    registry.take({}, now=105.5)
    assert os.listdir(tmp_path / "cancels") == []
    other = CancelRegistry(tmp_path / "cancels")
    registry.close()
    assert not (tmp_path / "cancels").exists()
    other.record("late", at=200.0)  # an instance still running recreates it
    assert other.take({"late": 199.0}, now=200.0) == {"late": 200.0}


def test_the_launcher_removes_what_a_server_left(tmp_path):
    pid = 2 ** 22 + 7  # beyond the default pid_max: no server of this host
    CancelRegistry(registry_dir(pid)).record("left by a crash")
    assert registry_dir(pid).is_dir() and registry_dir(pid).name == f"omni-triton-cancels-{pid}"
    remove_registry(pid)
    assert not registry_dir(pid).exists()
