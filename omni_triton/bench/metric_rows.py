"""One line of a breakdown table whose columns are levels (or rates) and whose cells are metrics: the engines'
(step_breakdown.py) and code2wav's (code2wav_breakdown.py). Pure functions."""

from __future__ import annotations


def metric_row(label: str, columns: list[dict], keys: tuple[str, ...], fmt: str) -> str | None:
    """``| label | cell | ... |``, a cell per column: ``fmt`` of the column's ``keys``, blank where any of them is
    unknown (None or absent: a level without such records, records from older traces); None when every cell is."""
    cells = []
    for metrics in columns:
        values = [metrics.get(key) for key in keys]
        cells.append(None if any(value is None for value in values) else fmt.format(*values))
    if all(cell is None for cell in cells):
        return None
    return f"| {label} | " + " | ".join(cell or "" for cell in cells) + " |"
