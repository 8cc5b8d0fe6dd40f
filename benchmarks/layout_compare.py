"""GPU layouts against one GPU (issue 43): closed-loop bench runs of the same workload, grouped per layout, summed
where several servers were measured at once, as a table of requests/s per layout and streams per GPU against the
one-GPU layout's at the same streams per GPU.

    python benchmarks/layout_compare.py --layout "one GPU:1:OUT/one" \
        --layout "two servers:2:OUT/side0,OUT/side1" --layout "two pipelines:2:OUT/pipelines" --out OUT/layouts.json

Each ``--layout NAME:GPUS:DIR[,DIR...]`` names a layout, the GPUs it used and the ``omni-triton bench --out`` dirs
measured at the same time (one per server: their levels ran together). A level's streams are the sum of its
servers' concurrency; its requests/s the sum of theirs; TTFA p50 / p95 the worst server's (a listener on the slower
server hears that); streams that ran dry and failed requests summed. Prints a markdown table; exit status 1 when a
run dir has no results.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import NamedTuple


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
        comparison = compare([layout for layout, _ in present], [servers for _, servers in present])
        print(markdown(comparison))
        if args.out:
            args.out.write_text(json.dumps(comparison, indent=2) + "\n")
    return 1 if missing or not present else 0


if __name__ == "__main__":
    sys.exit(main())
