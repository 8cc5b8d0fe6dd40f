"""benchmarks/prefix_cache_bench.py --compare: two served runs' reports (cache on, off) side by side."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from prefix_cache_bench import main  # noqa: E402


def output(text: str, audio: str) -> dict:
    return {"text": text, "audio": audio, "audio_samples": 1920}


def run_report(label: str, turn_ttfa_s: list[float], shared_ttfa_s: float, requests_per_s: float,
               last_reply: dict = output("t2", "a2")) -> dict:
    replies = [output("t1", "a1"), last_reply]
    turns = [{"turn": i + 1, "prompt_tokens": 1000 + 200 * i, "ttfa_s": t, "ttft_s": t / 2, "output": replies[i]}
             for i, t in enumerate(turn_ttfa_s)]
    gauges = {"omni_prefix_cache_hit_tokens{thinker}": 900.0, "omni_prefix_cache_query_tokens{thinker}": 1200.0}
    return {label: {"conversation": {"turns": turns, "turn_ttfa_ratio": turn_ttfa_s[-1] / turn_ttfa_s[0],
                                     "gauges": gauges},
                    "shared_prompt": {"requests": 64, "concurrency": 32, "ttfa_p50_s": shared_ttfa_s,
                                      "requests_per_s": requests_per_s, "gauges": gauges,
                                      "outputs": [output("s", "a"), last_reply]}}}


def test_compare_gives_the_ratios_and_tables(tmp_path, capsys):
    on, off, out = tmp_path / "on.json", tmp_path / "off.json", tmp_path / "compare.json"
    on.write_text(json.dumps(run_report("on", [0.2, 0.1], 0.3, 8.0)))
    # the second reply differs in its audio only
    off.write_text(json.dumps(run_report("off", [0.2, 0.4], 0.6, 4.0, last_reply=output("t2", "other"))))
    assert main(["--compare", str(on), str(off), "--out", str(out)]) == 0
    ratios = json.loads(out.read_text())["ratios_on_to_off"]
    assert ratios == {"conversation_turn_ttfa": [1.0, 0.25], "shared_prompt_ttfa_p50": 0.5,
                      "shared_prompt_requests_per_s": 2.0,
                      "same_outputs": {"conversation": {"compared": 2, "text": 2, "audio": 1},
                                       "shared_prompt": {"compared": 2, "text": 2, "audio": 1}}}
    printed = capsys.readouterr().out
    assert "| 2 | 1200 | 100 | 400 | 0.25 |" in printed
    assert "last turn / first turn TTFA: on 0.50, off 2.00" in printed
    assert "| TTFA p50 ms | 300 | 600 | 0.50 |" in printed and "thinker 900 / 1200" in printed
    assert "conversation 2, 1 / 2; shared_prompt 2, 1 / 2" in printed
