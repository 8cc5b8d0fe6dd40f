"""Summaries of py-spy raw profiles (``py-spy record --threads --idle --format raw``, as
``benchmarks/pyspy_stages.sh`` writes one per stage stub): per stub, over all its threads together and then per
thread, where its samples end (the leaf frame) and which of this project's frames they pass through (inclusive), as
% of those samples. Recorded with ``--gil`` instead of ``--idle`` (pyspy_stages.sh's MODE gil), a sample is a
moment some thread held the stub's GIL, so the all-threads section says where the stub's Python time goes.

    python -m omni_triton.bench.pyspy_summary DIR [--top 8] [--out DIR/pyspy_summary.md]
"""

from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict
from pathlib import Path

OWN_CODE = ("omni_triton/", "model.py")
_LINE = re.compile(r"^(?P<stack>.*) (?P<count>\d+)$")


def parse(text: str) -> dict[str, list[tuple[list[str], int]]]:
    """Raw collapsed stacks -> {thread name: [(frames root first, samples)]}; the thread frame is
    ``thread (tid): name`` (py-spy --threads), kept as the key without its id."""
    threads: dict[str, list[tuple[list[str], int]]] = defaultdict(list)
    for line in text.splitlines():
        match = _LINE.match(line.strip())
        if not match:
            continue
        frames = match["stack"].split(";")
        thread = frames[0].split(": ", 1)[-1] if frames[0].startswith("thread") else "?"
        threads[thread].append((frames[1:], int(match["count"])))
    return dict(threads)


def summarise(stacks: list[tuple[list[str], int]], top: int) -> tuple[int, list[tuple[str, float]],
                                                                     list[tuple[str, float]]]:
    """(samples, top leaf frames, top own-code frames inclusive) of one thread, shares in % of its samples."""
    total = sum(count for _, count in stacks)
    leaves: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    for frames, count in stacks:
        leaves[frames[-1] if frames else "(no frame)"] += count
        for frame in set(frames):
            if any(part in frame for part in OWN_CODE):
                inclusive[frame] += count
    share = lambda counter: [(frame, 100.0 * count / total) for frame, count in counter.most_common(top)]
    return total, share(leaves), share(inclusive)


def report(directory: Path, top: int) -> str:
    lines = [f"# py-spy: where each stage stub's threads spend their samples ({directory})", ""]
    for path in sorted(directory.glob("*.txt")):
        if path.name in ("stubs.txt", "top_threads.txt"):
            continue
        threads = parse(path.read_text())
        # a stub's work is spread over many short-lived threads (one per request and stream in the orchestrator):
        # each one alone looks small, so the sum over all of them comes first
        everything = [stack for stacks in threads.values() for stack in stacks]
        for thread, stacks in [("all threads", everything), *sorted(threads.items())]:
            lines += _section(f"{path.stem} / {thread}", stacks, top)
    return "\n".join(lines)


def _section(title: str, stacks: list[tuple[list[str], int]], top: int) -> list[str]:
    total, leaves, inclusive = summarise(stacks, top)
    if total == 0:
        return []
    lines = [f"## {title} ({total} samples)", "", "| leaf frame | % |", "|---|---:|"]
    lines += [f"| `{frame}` | {pct:.1f} |" for frame, pct in leaves]
    lines += ["", "| project frame (inclusive) | % |", "|---|---:|"]
    lines += [f"| `{frame}` | {pct:.1f} |" for frame, pct in inclusive]
    return lines + [""]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--out", type=Path, help="write the report here too (default: print only)")
    args = parser.parse_args(argv)
    text = report(args.directory, args.top)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
