"""GPU layouts against one GPU (issue 43): bench runs of the same workload, grouped per layout, summed where
several servers were measured at once. Closed-loop runs: a table of requests/s per layout and streams per GPU
against the one-GPU layout's at the same streams per GPU. Open-loop runs (``omni-triton bench --request-rate``): a
table per layout and offered rate, and each layout's goodput against one GPU's.

    python benchmarks/layout_compare.py --layout "one GPU:1:OUT/one" \
        --layout "two servers:2:OUT/side0,OUT/side1" --layout "two pipelines:2:OUT/pipelines" --out OUT/layouts.json

Each ``--layout NAME:GPUS:DIR[,DIR...]`` names a layout, the GPUs it used and the ``omni-triton bench --out`` dirs
measured at the same time (one per server: their levels ran together). A level's streams are the sum of its
servers' concurrency; its requests/s the sum of theirs; TTFA p50 / p95 the worst server's (a listener on the slower
server hears that); streams that ran dry and failed requests summed. Prints a markdown table; exit status 1 when a
run dir has no results.json.

Open loop: every server of a layout ran the same rates (its own bench, all at once); a layout's rate is the sum of
its servers' rates, its completed requests/s the sum of theirs, and it passes only if it passed on every server
(TTFA p95 within the limit, none dry, none failed or unsent: bench/goodput.py's verdict, per server). The goodput
is the highest passing rate; a rate not every server measured (a bench cut short) is left out, and said so.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import NamedTuple

from omni_triton.bench.goodput import highest_passing
from omni_triton.bench.report import ms


class Layout(NamedTuple):
    name: str
    gpus: int
    run_dirs: tuple[Path, ...]


def parse_layout(text: str) -> Layout:
    parts = text.split(":", 2)
    if len(parts) != 3 or not parts[0] or not parts[1].isdigit() or int(parts[1]) < 1 or not parts[2]:
        raise ValueError(f"--layout {text!r}: expected NAME:GPUS:DIR[,DIR...] with GPUS >= 1")
    return Layout(parts[0], int(parts[1]), tuple(Path(p) for p in parts[2].split(",")))


def combined_levels(reports: list[dict]) -> list[dict]:
    """The levels every server measured (a server's level i ran with the others' level i), summed."""
    per_server = [[row for row in report.get("results", []) if row.get("system") == "server"] for report in reports]
    levels = []
    for rows in zip(*per_server):
        levels.append({
            "streams": sum(row["concurrency"] for row in rows),
            "requests_per_s": sum(row["requests_per_s"] for row in rows),
            "ttfa_p50": max(row["ttfa_p50"] for row in rows),
            "ttfa_p95": max(row["ttfa_p95"] for row in rows),
            "ran_dry": sum(row.get("ran_dry", 0) for row in rows),
            "requests": sum(row["requests"] for row in rows),
            "failed": sum(row.get("failed", 0) for row in rows),
        })
    return levels


def compare(layouts: list[Layout], reports: list[list[dict]]) -> dict:
    """Every layout's levels (``reports[i]``: layout i's servers' reports), each with requests/s over the first
    layout's at the same streams per GPU. A name may come several times (e.g. one entry per level measured apart)."""
    rows = []
    for layout, servers in zip(layouts, reports):
        for level in combined_levels(servers):
            rows.append({"layout": layout.name, "gpus": layout.gpus,
                         "streams_per_gpu": level["streams"] / layout.gpus, **level})
    reference = layouts[0]
    base = {row["streams_per_gpu"]: row for row in rows if row["layout"] == reference.name}
    for row in rows:
        match = base.get(row["streams_per_gpu"])
        row["x_reference"] = (row["requests_per_s"] / match["requests_per_s"]
                              if match and match["requests_per_s"] else None)
    return {"reference": reference.name, "rows": rows}


def markdown(comparison: dict) -> str:
    lines = [f"| layout | GPUs | streams | per GPU | requests/s | x {comparison['reference']} | TTFA p50 / p95 ms | "
             "ran dry | failed |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in comparison["rows"]:
        ratio = f"{row['x_reference']:.2f}" if row["x_reference"] is not None else "-"
        lines.append(f"| {row['layout']} | {row['gpus']} | {row['streams']} | {row['streams_per_gpu']:g} | "
                     f"{row['requests_per_s']:.2f} | {ratio} | {row['ttfa_p50'] * 1e3:.0f} / "
                     f"{row['ttfa_p95'] * 1e3:.0f} | {row['ran_dry']} of {row['requests']} | {row['failed']} |")
    return "\n".join(lines)


def is_open_loop(report: dict) -> bool:
    return "open_loop" in report


def _worst(values: list) -> float | None:
    """The slowest server's latency; None (a server had no audio at that rate) is worse than any."""
    return None if any(value is None for value in values) else max(values)


def combined_rates(servers: dict[str, dict]) -> tuple[list[dict], list[float]]:
    """The rates every server measured (``servers``: name -> its open-loop report; their rate lists ran at once),
    each summed over the servers and passing only where every server passed; and the rates some server lacks."""
    per_server = {name: {row["rate"]: row for row in report["rates"]} for name, report in servers.items()}
    every = set.intersection(*(set(rows) for rows in per_server.values()))
    some = set().union(*(set(rows) for rows in per_server.values()))
    combined = []
    for rate in sorted(every):
        rows = {name: by_rate[rate] for name, by_rate in per_server.items()}
        combined.append({
            "rate": sum(row["rate"] for row in rows.values()),
            "requests_per_s": sum(row["requests_per_s"] or 0.0 for row in rows.values()),
            "ttfa_p50": _worst([row["ttfa_p50"] for row in rows.values()]),
            "ttfa_p95": _worst([row["ttfa_p95"] for row in rows.values()]),
            "ran_dry": sum(row["ran_dry"] or 0 for row in rows.values()),
            "sent": sum(row["sent"] for row in rows.values()),
            "completed": sum(row["completed"] for row in rows.values()),
            "failed": sum(sum(row["failed_by_code"].values()) + row["not_started"] for row in rows.values()),
            "passes": all(row["passes"] for row in rows.values()),
            "verdicts": {name: row["verdict"] for name, row in rows.items() if not row["passes"]},
        })
    return combined, sorted(some - every)


def _ratio_bound(layout_at_ceiling: bool, reference_at_ceiling: bool) -> str:
    """What a goodput ratio is when a goodput is the highest rate its layout tried (it may pass higher)."""
    if layout_at_ceiling:
        return "unknown" if reference_at_ceiling else "lower"
    return "upper" if reference_at_ceiling else "exact"


def compare_goodput(layouts: list[Layout], reports: list[list[dict]]) -> dict:
    """Every layout's rates (``reports[i]``: layout i's servers' open-loop reports) summed over its servers, and
    its goodput over the first layout's. Raises ValueError when the runs used different TTFA p95 limits."""
    limits = {report["goodput"]["ttfa_p95_limit_s"] for servers in reports for report in servers}
    if len(limits) > 1:
        raise ValueError(f"the runs' TTFA p95 limits differ ({sorted(limits)} s): their goodputs do not compare")
    rows, goodputs, notes = [], [], []
    for layout, servers in zip(layouts, reports):
        names = [run_dir.name if [d.name for d in layout.run_dirs].count(run_dir.name) == 1 else str(run_dir)
                 for run_dir in layout.run_dirs]
        notes += [f"{layout.name}: {name} was cut short (measured: {_rates(row['rate'] for row in report['rates'])})"
                  for name, report in zip(names, servers) if report.get("partial")]
        combined, uneven = combined_rates(dict(zip(names, servers)))
        if uneven:
            notes.append(f"{layout.name}: rate(s) {_rates(uneven)} per server left out: not every server "
                         "measured them")
        for rate in combined:
            rows.append({"layout": layout.name, "gpus": layout.gpus, "rate_per_gpu": rate["rate"] / layout.gpus,
                         **rate})
        tried = {rate["rate"]: rate["passes"] for rate in combined}
        found = highest_passing(tried)
        goodputs.append({"layout": layout.name, "gpus": layout.gpus, "requests_per_s": found,
                         "per_gpu": None if found is None else found / layout.gpus,
                         "at_ceiling": found is not None and found == max(tried),
                         "tried": [[rate, ok] for rate, ok in tried.items()]})
    reference = goodputs[0]
    for goodput in goodputs:
        both = goodput["requests_per_s"] is not None and reference["requests_per_s"]
        goodput["x_reference"] = goodput["requests_per_s"] / reference["requests_per_s"] if both else None
        goodput["x_reference_bound"] = (_ratio_bound(goodput["at_ceiling"], reference["at_ceiling"])
                                        if both else None)
    return {"reference": reference["layout"], "ttfa_p95_limit_s": limits.pop(), "rows": rows,
            "goodputs": goodputs, "notes": notes}


_BOUND_PREFIX = {"exact": "", "lower": ">= ", "upper": "<= ", "unknown": "? "}


def goodput_markdown(comparison: dict) -> str:
    limit_ms = comparison["ttfa_p95_limit_s"] * 1000
    lines = ["| layout | GPUs | rate /s | per GPU | completed req/s | TTFA p50 / p95 ms | ran dry | failed | passes |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in comparison["rows"]:
        passes = "yes" if row["passes"] else "no: " + "; ".join(f"{name}: {verdict}"
                                                              for name, verdict in row["verdicts"].items())
        lines.append(f"| {row['layout']} | {row['gpus']} | {row['rate']:g} | {row['rate_per_gpu']:g} | "
                     f"{row['requests_per_s']:.2f} | {ms(row['ttfa_p50'])} / {ms(row['ttfa_p95'])} | "
                     f"{row['ran_dry']} of {row['completed']} | {row['failed']} of {row['sent']} | {passes} |")
    lines += ["", f"Goodput: the highest rate that passed on every server of the layout (TTFA p95 <= {limit_ms:.0f} "
                  "ms, none dry, none failed or unsent). >=: the highest rate the layout tried, it may serve more (its "
                  f"ratio a lower bound; <=: {comparison['reference']}'s was; ?: both were).",
              "", f"| layout | GPUs | goodput req/s | per GPU | x {comparison['reference']} | rates tried /s |",
              "|---|---:|---:|---:|---:|---|"]
    for goodput in comparison["goodputs"]:
        found, at_ceiling = goodput["requests_per_s"], goodput["at_ceiling"]
        cell = "none passed" if found is None else f"{'>= ' if at_ceiling else ''}{found:g}"
        per_gpu = "-" if found is None else f"{'>= ' if at_ceiling else ''}{goodput['per_gpu']:g}"
        ratio = ("-" if goodput["x_reference"] is None
                 else f"{_BOUND_PREFIX[goodput['x_reference_bound']]}{goodput['x_reference']:.2f}")
        tried = ", ".join(f"{rate:g} {'pass' if ok else 'fail'}" for rate, ok in goodput["tried"]) or "none"
        lines.append(f"| {goodput['layout']} | {goodput['gpus']} | {cell} | {per_gpu} | {ratio} | {tried} |")
    if comparison["notes"]:
        lines += [""] + [f"- {note}" for note in comparison["notes"]]
    return "\n".join(lines)


def _rates(rates) -> str:
    return ", ".join(f"{rate:g}/s" for rate in rates) or "none"



def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layout", action="append", required=True, metavar="NAME:GPUS:DIR[,DIR...]",
                        help="a layout; the first is the reference (one GPU)")
    parser.add_argument("--out", type=Path, help="write the comparison as JSON here")
    args = parser.parse_args(argv)
    try:
        layouts = [parse_layout(text) for text in args.layout]
    except ValueError as error:
        parser.error(str(error))
    present: list[tuple[Layout, list[dict]]] = []
    missing = False
    for layout in layouts:
        paths = [run_dir / "results.json" for run_dir in layout.run_dirs]
        for path in paths:
            if not path.is_file():
                print(f"layout_compare: {layout.name}: {path}: no such file (that run finished no level)",
                      file=sys.stderr)
                missing = True
        if all(path.is_file() for path in paths):
            present.append((layout, [json.loads(path.read_text()) for path in paths]))
    if present:
        open_loop = {is_open_loop(report) for _, servers in present for report in servers}
        if len(open_loop) > 1:
            print("layout_compare: open-loop (--request-rate) and closed-loop runs do not compare: give one kind",
                  file=sys.stderr)
            return 1
        measured = [layout for layout, _ in present], [servers for _, servers in present]
        try:
            comparison = compare_goodput(*measured) if open_loop.pop() else compare(*measured)
        except ValueError as error:
            print(f"layout_compare: {error}", file=sys.stderr)
            return 1
        print(goodput_markdown(comparison) if "goodputs" in comparison else markdown(comparison))
        if args.out:
            args.out.write_text(json.dumps(comparison, indent=2) + "\n")
    return 1 if missing or not present else 0


if __name__ == "__main__":
    sys.exit(main())
