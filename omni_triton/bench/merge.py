"""`omni-triton bench --merge DIR [DIR ...] --out OUT`: one report from several bench runs.

One command on a lent GPU machine may run 10 minutes at most, so a sweep runs as several `omni-triton bench`
commands (some levels each, or some systems each), each with its own --out. Merging concatenates their rows,
recomputes the ratios to `server` (a server row of one run and an inprocess row of another compare when they
are at the same concurrency), re-plots, and keeps every input's command, machine, notes (KV plans included) in
``merged_from``. Runs merge only when they measured the same thing: the same workload lengths (prompt, thinker
tokens, audio frames), on the same CPU and GPU model, with no system measured twice at one concurrency.

Open-loop runs (--request-rate) merge with each other the same way: their rates concatenated (none measured
twice), the goodput recomputed as the highest passing rate of them all; they must have measured the same system
with the same duration, arrival seed, arrivals (`--arrivals`; a run from before it had poisson ones) and TTFA limit.
A closed-loop run and an open-loop one do not merge.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from omni_triton.bench import breakdown, open_loop_report
from omni_triton.bench import report as reporting
from omni_triton.bench.goodput import highest_passing
from omni_triton.bench.metrics import LevelSummary, ratios_to
from omni_triton.bench.open_loop import arrivals_of

# Workload fields that must agree: what a request does. The rest (concurrencies, requests per level, warm-up)
# may differ between the runs of one sweep.
SAME_WORKLOAD = ("prompt_tokens", "thinker_tokens", "audio_frames")
# Machine fields that must agree: what the numbers were measured on (load average, git commit may differ).
SAME_MACHINE = ("cpu", "gpu")
# Open-loop settings that must agree: what a rate's row means.
# "mix": the soak's requests (--mix), another workload than the fixed one; "arrivals": how many a rate offers
SAME_OPEN_LOOP = ("system", "duration_s", "arrival_seed", "arrivals", "mix")


class MergeError(ValueError):
    """Runs that cannot be merged; the message names the dirs and what differs."""


def read_run(run_dir: Path) -> dict:
    path = Path(run_dir) / "results.json"
    try:
        report = json.loads(path.read_text())
    except FileNotFoundError:
        raise MergeError(f"{path}: no such file (is {run_dir} an `omni-triton bench --out` dir?)") from None
    except json.JSONDecodeError as error:
        raise MergeError(f"{path}: not JSON ({error})") from None
    rows_key = "rates" if "open_loop" in report else "results"
    for key in (rows_key, "workload", "machine", "command"):
        if key not in report:
            raise MergeError(f"{path}: no {key!r}: not an `omni-triton bench` results.json")
    if "open_loop" in report:  # a run from before --arrivals says so
        report["open_loop"]["arrivals"] = arrivals_of(report["open_loop"])
    return report


def _check_agreement(runs: dict[Path, dict], section: str, keys: tuple[str, ...]) -> None:
    for key in keys:
        values = {str(run_dir): run[section].get(key) for run_dir, run in runs.items()}
        if len(set(map(json.dumps, values.values()))) > 1:
            raise MergeError(f"runs differ in {section} {key}: "
                             + ", ".join(f"{run_dir}: {value!r}" for run_dir, value in values.items()))


def _rows(runs: dict[Path, dict]) -> list[LevelSummary]:
    """Every run's rows, refusing a system measured twice at one concurrency."""
    seen: dict[tuple[str, int], Path] = {}
    rows = []
    for run_dir, run in runs.items():
        for row in run["results"]:
            try:
                summary = LevelSummary.from_dict(row)
            except (TypeError, ValueError) as error:
                raise MergeError(f"{run_dir}/results.json: {error}") from None
            level = (summary.system, summary.concurrency)
            if level in seen:
                raise MergeError(f"{summary.system} at concurrency {summary.concurrency} is in both {seen[level]} "
                                 f"and {run_dir}: merge runs that measured different levels or systems")
            seen[level] = run_dir
            rows.append(summary)
    return rows


def _agreed(values: list):
    """The value where all agree, else the distinct values joined by " / " (for the report's header)."""
    distinct = list(dict.fromkeys(json.dumps(value, sort_keys=True) for value in values))
    return values[0] if len(distinct) == 1 else " / ".join(str(json.loads(value)) for value in distinct)


def _combined(dicts: list[dict]) -> dict:
    return {key: _agreed([d.get(key) for d in dicts]) for key in dict.fromkeys(key for d in dicts for key in d)}


def _read_runs(run_dirs: list[Path], out_dir: Path) -> dict[Path, dict]:
    """Each run dir's report, once the dirs and the runs' workloads and machines are checked."""
    run_dirs = [Path(d) for d in run_dirs]
    if len(run_dirs) < 2:
        raise MergeError(f"--merge needs at least two run dirs, got {len(run_dirs)}")
    if len(set(map(Path.resolve, run_dirs))) < len(run_dirs):
        raise MergeError(f"a run dir is given twice: {[str(d) for d in run_dirs]}")
    if Path(out_dir).resolve() in {d.resolve() for d in run_dirs}:
        raise MergeError(f"--out {out_dir} is one of the merged dirs: it would overwrite that run's results")
    runs = {run_dir: read_run(run_dir) for run_dir in run_dirs}
    open_loop = [str(run_dir) for run_dir, run in runs.items() if "open_loop" in run]
    if open_loop and len(open_loop) < len(runs):
        raise MergeError(f"open-loop runs ({', '.join(open_loop)}) do not merge with closed-loop ones")
    _check_agreement(runs, "workload", SAME_WORKLOAD)
    _check_agreement(runs, "machine", SAME_MACHINE)
    return runs


def _merged_header(runs: dict[Path, dict], out_dir: Path, label: str | None) -> dict:
    """What every merged report starts with: label, the merge command, the runs merged, the machine, workload
    and weights they agree on."""
    known_prompt_ids = [run["prompt_ids"] for run in runs.values() if run.get("prompt_ids", "unknown") != "unknown"]
    return {
        "label": label or Path(out_dir).name,
        "command": "omni-triton bench " + shlex.join(
            ["--merge", *map(str, runs), "--out", str(out_dir)] + (["--label", label] if label else [])),
        "merged_from": [_provenance(run_dir, run) for run_dir, run in runs.items()],
        "machine": _combined([run["machine"] for run in runs.values()]),
        "workload": _combined([run["workload"] for run in runs.values()]),
        "prompt_ids": _agreed(known_prompt_ids) if known_prompt_ids else "unknown",
        "weights": _agreed([run.get("weights", "unknown") for run in runs.values()]),
        # each run's notes (KV plans, skipped systems), named by the run they came from
        "notes": [f"[{run_dir}] {note}" for run_dir, run in runs.items() for note in run.get("notes", [])],
    }


def merge(run_dirs: list[Path], out_dir: Path, label: str | None = None, reference: str = "server",
          system_order: tuple[str, ...] = ()) -> tuple[dict, list[LevelSummary]]:
    """The merged report (results.json's content) and its rows, ordered by ``system_order`` then concurrency.
    Raises MergeError when the runs cannot be merged."""
    runs = _read_runs(run_dirs, out_dir)
    order = {system: index for index, system in enumerate(system_order)}
    summaries = sorted(_rows(runs), key=lambda s: (order.get(s.system, len(order)), s.system, s.concurrency))

    report = _merged_header(runs, out_dir, label)
    report["workload"]["concurrencies"] = sorted({s.concurrency for s in summaries})
    report.update({
        "torch_threads": _agreed([run.get("torch_threads") for run in runs.values()]),
        "results": [s.to_dict() for s in summaries],
        "ratios_to": reference,
        "ratios": ratios_to(reference, summaries),
        "ttfa_breakdown": [row for run in runs.values() for row in run.get("ttfa_breakdown", [])],
    })
    return report, summaries


def merge_open_loop(runs: dict[Path, dict], out_dir: Path, label: str | None = None) -> dict:
    """The merged report of open-loop runs: their rates in rate order (and their TTFA breakdowns, from --trace),
    the goodput of them all."""
    _check_agreement(runs, "open_loop", SAME_OPEN_LOOP)
    limits = {str(run_dir): run["goodput"]["ttfa_p95_limit_s"] for run_dir, run in runs.items()}
    if len(set(limits.values())) > 1:
        raise MergeError(f"runs differ in their TTFA p95 limit (s): {limits}")
    seen: dict[float, Path] = {}
    for run_dir, run in runs.items():
        for row in run["rates"]:
            if row["rate"] in seen:
                raise MergeError(f"rate {row['rate']:g}/s is in both {seen[row['rate']]} and {run_dir}: merge runs "
                                 "that measured different rates")
            seen[row["rate"]] = run_dir
    rows = sorted((row for run in runs.values() for row in run["rates"]), key=lambda row: row["rate"])
    tried = [(row["rate"], row["passes"]) for row in rows]
    first = next(iter(runs.values()))
    return {**_merged_header(runs, out_dir, label), "open_loop": first["open_loop"],
            "goodput": {"system": first["goodput"]["system"], "requests_per_s": highest_passing(dict(tried)),
                        "ttfa_p95_limit_s": first["goodput"]["ttfa_p95_limit_s"], "tried": tried, "search": None},
            "rates": rows, "ttfa_breakdown": [row for run in runs.values() for row in run.get("ttfa_breakdown", [])]}


def _provenance(run_dir: Path, run: dict) -> dict:
    """What one merged run was: its dir, command, label and machine (with its load and git commit), the GPU
    memory in use at its start; a merged run keeps its own inputs."""
    entry = {"dir": str(run_dir), "command": run["command"], "label": run.get("label"), "machine": run["machine"],
             "gpu_memory_used_gib_at_start": run.get("gpu_memory_used_gib_at_start")}
    if "merged_from" in run:
        entry["merged_from"] = run["merged_from"]
    return entry


def write_merged(run_dirs: list[Path], out_dir: Path, label: str | None = None, reference: str = "server",
                 system_order: tuple[str, ...] = ()) -> tuple[dict, str]:
    """Merge ``run_dirs`` into ``out_dir`` (results.json, results.md, plots); the report and its markdown."""
    out_dir = Path(out_dir)
    runs = _read_runs(run_dirs, out_dir)
    if all("open_loop" in run for run in runs.values()):
        report = merge_open_loop(runs, out_dir, label)
        return report, open_loop_report.write(report, out_dir)[0]
    report, summaries = merge(run_dirs, out_dir, label, reference, system_order)
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = reporting.plot(summaries, out_dir)
    if isinstance(plots, str):
        report["notes"].append(plots)
    reporting.write_json(out_dir / "results.json", report)
    table = reporting.markdown(report, summaries, report["ratios"], reference)
    table += breakdown.report_section(report["ttfa_breakdown"])
    (out_dir / "results.md").write_text(table)
    return report, table
