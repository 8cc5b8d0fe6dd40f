"""Two `omni-triton bench` runs of the same workload against two servers (one serve flag apart, e.g.
``--quantization fp8`` against bf16), side by side: per closed-loop level requests/s, audio-s/s, TTFT/TTFA and
streams that ran dry, or the goodput of two open-loop runs, each with the second run's value over the first's.

    python benchmarks/served_compare.py OUT/bf16 OUT/fp8 --labels bf16,fp8 --out OUT/compare.json

(``omni-triton bench --merge`` refuses this on purpose: it merges runs that measured different levels or systems,
not the same level twice.) Prints a markdown table; exit status 1 when a run is missing or they share nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# closed-loop fields compared (results.json's rows): name, table header, scale to the table's unit
LEVEL_FIELDS = (("requests_per_s", "req/s", 1.0), ("audio_s_per_s", "audio s/s", 1.0),
                ("ttft_p50", "TTFT p50 ms", 1e3), ("ttfa_p50", "TTFA p50 ms", 1e3), ("ttfa_p95", "TTFA p95 ms", 1e3),
                ("gpu_memory_peak_gib", "GPU GiB", 1.0))


def _ratio(base, other) -> float | None:
    return other / base if isinstance(base, (int, float)) and isinstance(other, (int, float)) and base else None


def closed_loop_levels(base: dict, other: dict) -> list[dict]:
    """Every (system, concurrency) both runs measured: each of ``LEVEL_FIELDS`` for both and other / base, the
    streams that ran dry and the failed requests of each."""
    theirs = {(r["system"], r["concurrency"]): r for r in other.get("results", [])}
    levels = []
    for row in base.get("results", []):
        match = theirs.get((row["system"], row["concurrency"]))
        if match is None:
            continue
        level = {"system": row["system"], "concurrency": row["concurrency"]}
        for name, _, _ in LEVEL_FIELDS:
            level[name] = {"base": row.get(name), "other": match.get(name), "ratio": _ratio(row.get(name),
                                                                                            match.get(name))}
        for name in ("ran_dry", "failed", "requests"):
            level[name] = {"base": row.get(name), "other": match.get(name)}
        levels.append(level)
    return levels


def goodputs(base: dict, other: dict) -> dict | None:
    """The two open-loop runs' goodput (None where no rate passed) and other / base; None unless both are open
    loop."""
    if "goodput" not in base or "goodput" not in other:
        return None
    rates = [run["goodput"]["requests_per_s"] for run in (base, other)]
    return {"base": rates[0], "other": rates[1], "ratio": _ratio(*rates),
            "tried": {"base": base["goodput"]["tried"], "other": other["goodput"]["tried"]}}


def compare(base: dict, other: dict, labels: tuple[str, str]) -> dict:
    return {"labels": list(labels), "levels": closed_loop_levels(base, other), "goodput": goodputs(base, other)}


def _cell(value, scale: float = 1.0) -> str:
    if value is None:
        return "-"
    return f"{value * scale:.0f}" if scale != 1.0 else f"{value:.2f}"


def markdown(comparison: dict) -> str:
    base, other = comparison["labels"]
    lines = []
    if comparison["levels"]:
        lines += [f"Closed loop, {base} -> {other} ({other} / {base} in brackets):", "",
                  "| system | conc | " + " | ".join(header for _, header, _ in LEVEL_FIELDS) + " | ran dry | failed |",
                  "|---|---:|" + "---:|" * (len(LEVEL_FIELDS) + 2)]
        for level in comparison["levels"]:
            cells = []
            for name, _, scale in LEVEL_FIELDS:
                value = level[name]
                ratio = f" ({value['ratio']:.2f}x)" if value["ratio"] is not None else ""
                cells.append(f"{_cell(value['base'], scale)} -> {_cell(value['other'], scale)}{ratio}")
            cells += [f"{level[name]['base']} -> {level[name]['other']}" for name in ("ran_dry", "failed")]
            lines.append(f"| {level['system']} | {level['concurrency']} | " + " | ".join(cells) + " |")
        lines.append("")
    if comparison["goodput"] is not None:
        g = comparison["goodput"]
        tried = {side: ", ".join(f"{rate:g} {'pass' if ok else 'fail'}" for rate, ok in g["tried"][side])
                 for side in ("base", "other")}
        lines += [f"Goodput (requests/s): {base} {_cell(g['base'])}, {other} {_cell(g['other'])}"
                  + (f" ({g['ratio']:.2f}x)" if g["ratio"] is not None else "")
                  + f"; rates tried: {base} {tried['base']}; {other} {tried['other']}", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("base", type=Path, help="a bench --out dir (its results.json): the reference")
    parser.add_argument("other", type=Path, help="a bench --out dir of the same workload against the other server")
    parser.add_argument("--labels", default="base,other", help="names of the two runs, comma separated")
    parser.add_argument("--out", type=Path, help="write the comparison as JSON here")
    args = parser.parse_args(argv)
    labels = tuple(args.labels.split(","))
    if len(labels) != 2:
        parser.error(f"--labels: two names, got {args.labels!r}")
    reports = []
    for run_dir in (args.base, args.other):
        path = run_dir / "results.json"
        if not path.is_file():
            print(f"served_compare: {path}: no such file (that run did not finish a level)", file=sys.stderr)
            return 1
        reports.append(json.loads(path.read_text()))
    comparison = compare(*reports, labels)
    print(markdown(comparison))
    if args.out:
        args.out.write_text(json.dumps(comparison, indent=2) + "\n")
    if not comparison["levels"] and comparison["goodput"] is None:
        print("served_compare: the runs share no level and are not both open loop", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
