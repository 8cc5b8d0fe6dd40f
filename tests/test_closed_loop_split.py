"""benchmarks/closed_loop_split.py: a request's time split at its first audio, from the client's trace events."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from closed_loop_split import main, request_times, summary  # noqa: E402


def write_trace(folder: Path, requests: dict[str, tuple]) -> None:
    folder.mkdir(parents=True)
    lines = []
    for rid, marks in requests.items():
        for name, t in zip(("client.sent", "client.first_audio", "client.finished"), marks):
            if t is not None:
                lines.append(json.dumps({"id": rid, "event": name, "t": t, "pid": 1}))
    (folder / "1.jsonl").write_text("\n".join(lines) + "\n")


def test_the_split_of_each_finished_request(tmp_path):
    write_trace(tmp_path / "served/trace/server-c2", {"a": (10.0, 11.5, 14.0), "b": (10.0, 13.0, 15.0),
                                                      "cut": (10.0, 12.0, None)})
    times = sorted(request_times(tmp_path / "served/trace/server-c2"), key=lambda t: t["ttfa"])
    assert times == [dict(ttfa=1.5, streaming=2.5, total=4.0), dict(ttfa=3.0, streaming=2.0, total=5.0)]
    stats = summary(times)
    assert stats["requests"] == 2 and stats["ttfa_mean_s"] == 2.25 and stats["total_p50_s"] == 4.5


def test_main_prints_a_row_per_level_and_writes_json(tmp_path, capsys):
    write_trace(tmp_path / "run/served/trace/server-c1", {"a": (0.0, 0.2, 1.0)})
    write_trace(tmp_path / "run/served/trace/server-c4", {"b": (0.0, 0.5, 2.0)})
    assert main([str(tmp_path / "run")]) == 0
    rows = json.loads((tmp_path / "run/closed_loop_split.json").read_text())
    assert [r["concurrency"] for r in rows] == [1, 4] and rows[1]["streaming_mean_s"] == 1.5
    assert "| 4 | 1 |" in capsys.readouterr().out
    assert main([str(tmp_path)]) == 0 and main([str(tmp_path / "run/served/trace/server-c1")]) == 0
    assert main([str(tmp_path / "empty")]) == 1
