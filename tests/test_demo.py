"""`omni-triton demo` on the session's server: seeded by default (the same text twice), and it says what the
numbers ran on and that a random-weight checkpoint speaks noise."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from omni_triton import cli

pytestmark = pytest.mark.server


def run_demo(triton_server, tiny_checkpoint, tmp_path, capsys, monkeypatch) -> str:
    monkeypatch.setattr(cli, "start_server",
                        lambda args, echo_log: SimpleNamespace(grpc_url=triton_server.grpc_url, stop=lambda: None))
    assert cli.main(["demo", "--checkpoint", str(tiny_checkpoint), "--max-tokens", "8", "--max-audio-frames", "8",
                     "--out", str(tmp_path / "out.wav")]) == 0
    return capsys.readouterr().out


def test_demo_is_seeded_and_explains_itself(triton_server, tiny_checkpoint, tmp_path, capsys, monkeypatch):
    first = run_demo(triton_server, tiny_checkpoint, tmp_path, capsys, monkeypatch)
    second = run_demo(triton_server, tiny_checkpoint, tmp_path, capsys, monkeypatch)
    lines = first.splitlines()
    assert lines[0] == "random-weight checkpoint: text and audio are noise; see README"
    assert any(line.startswith("TTFT ") for line in lines)
    machine = next(line for line in lines if line.startswith("machine: "))
    assert " cores" in machine and "models on cpu" in machine and "seed 0" in machine
    # same seed, same streamed text (the first line after the notice)
    assert lines[1] == second.splitlines()[1] and lines[1]
