"""The soak's report (bench.soak_cli): results.md (every scenario's checks first, then its numbers) and soak.png
(TTFA p50/p95 per window, each process's RSS over the soak). results.json is the report dict itself."""

from __future__ import annotations

import json
from pathlib import Path

from omni_triton.bench.open_loop import arrivals_line
from omni_triton.bench.report import write_report


def failed_invariants(report: dict) -> list[str]:
    """Every invariant check that failed, as "scenario: check (detail)"."""
    return [f"{name}: {row['check']} ({row['detail']})" for name, result in _scenarios(report)
            for row in result.get("checks", []) if row["kind"] == "invariant" and not row["ok"]]


def _scenarios(report: dict) -> list[tuple[str, dict]]:
    found = [(name, report["scenarios"][name]) for name in ("soak", "burst") if name in report["scenarios"]]
    return found + [(f"kill {row['stage']}", row) for row in report["scenarios"].get("kill", [])]


def _checks(result: dict) -> list[str]:
    lines = ["| check | kind | ok | detail |", "|---|---|---|---|"]
    for row in result.get("checks", []):
        detail = str(row["detail"]).replace("|", "/").replace("\n", " ")
        lines.append(f"| {row['check']} | {row['kind']} | {'yes' if row['ok'] else '**no**'} | {detail} |")
    return lines


def _codes(result: dict) -> str:
    return "; ".join(f"{fate}: " + ", ".join(f"{code} x {count}" for code, count in codes.items())
                     for fate, codes in result.get("errors_by_fate_and_code", {}).items())


def markdown(report: dict) -> str:
    settings = report["settings"]
    lines = [f"# omni-triton soak, burst and killed stages: {report['label']}", "",
             f"Command: `{report['command']}`", "",
             "Machine: " + ", ".join(f"{key} {value}" for key, value in report["machine"].items()), "",
             f"Goodput given: {settings['goodput']:g} requests/s; rates: "
             + ", ".join(f"{name} {rate:g}/s" for name, rate in settings["rates"].items())
             + f". Request mix: `{json.dumps(settings['mix'])}`.", "",
             arrivals_line(settings), ""]
    failed = failed_invariants(report)
    lines += [f"Invariants: {'all hold' if not failed else f'{len(failed)} failed'}.", ""]
    if "soak" in report["scenarios"]:
        result = report["scenarios"]["soak"]
        lines += [f"## Soak: {result['rate']:g} requests/s for {result['duration_s']:g} s, {result['requests']} "
                  "requests", ""] + _checks(result) + ["", f"Requests by what they were meant to end with, and how "
                                                           f"they ended: {_codes(result)}.", ""]
        lines += ["| window start s | requests | TTFA p50 ms | TTFA p95 ms |", "|---:|---:|---:|---:|"]
        lines += [f"| {w['start_s']:g} | {w['requests']} | {w['ttfa_p50_ms']} | {w['ttfa_p95_ms']} |"
                  for w in result["ttfa_windows"]]
        lines += ["", f"Memory per process (RSS MiB; GPU MiB where nvidia-smi runs), sampled every "
                      f"{settings['sample_every_s']:g} s ({len(result['samples'])} samples):", "",
                  "| process | RSS start | after warm-up | end window | growth % | GPU start | GPU after warm-up | "
                  "GPU end window | GPU growth % |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for name, row in result["memory"].items():
            rss, gpu = row.get("rss_mib", {}), row.get("gpu_mib", {})
            lines.append(f"| {name} | {rss.get('start')} | {rss.get('after_warmup')} | {rss.get('end_window')} | "
                         f"{rss.get('growth_pct')} | {gpu.get('start', '-')} | {gpu.get('after_warmup', '-')} | "
                         f"{gpu.get('end_window', '-')} | {gpu.get('growth_pct', '-')} |")
        lines += ["", "Threads per process, idle at the start -> the most in the soak's first half -> in its second "
                      "half -> idle at the end (pools fill up to what the load needs by the first half and stay; "
                      "threads left behind grow on past it: the idle end is checked against the first half's): "
                  + ", ".join(f"{name} {row['start']} -> {row['first_half_most']} -> {row['second_half_most']} -> "
                              f"{row['end']}" for name, row in result["threads"].items())
                  + f". Shared-memory regions: {len(result['start']['shm_regions'])} -> "
                    f"{len(result['end']['shm_regions'])}. Idle {result['idle_after_s']} s after the last request.",
                  ""]
    if "burst" in report["scenarios"]:
        result = report["scenarios"]["burst"]
        lines += [f"## Burst: {result['factor']:g} x {result['base_rate']:g} requests/s for {result['burst_s']:g} s "
                  f"(base rate {result['before_s']:g} s before, {result['after_s']:g} s after)", ""] + _checks(result)
        lines += ["", f"Requests per phase: {result['requests']}; admitted {result['admitted']}, refused "
                      f"{result['refused']} (slowest refusal {result['refusal_ms_max']} ms; first audio of an "
                      f"admitted request at the earliest {result['admitted_ttfa_ms_min']} ms). How they ended: "
                      f"{_codes(result)}. TTFA p95 before the burst {result['baseline_ttfa_p95_ms']} ms (normal: "
                      f"<= {result['normal_ttfa_ms']} ms); normal again {result['recovered_after_s']} s after the "
                      "burst's end.", ""]
        if result["refusal_messages"]:
            lines += ["Refusals: " + " / ".join(f"`{message}`" for message in result["refusal_messages"][:2]), ""]
    for result in report["scenarios"].get("kill", []):
        lines += [f"## Killed stage: {result['stage']}", ""] + _checks(result) + [""]
        if "killed_at_s" not in result:
            continue
        lines += [f"At {result['rate']:g} requests/s, the stub (pid {result['killed_pid']}) killed "
                  f"{result['killed_at_s']:g} s in. In flight then: {result['in_flight_at_kill']} "
                  f"({result['in_flight_completed']} completed; the failed ones ended within "
                  f"{result['in_flight_failed_within_s']} s: {result['in_flight_errors'][:2]}). Sent while down: "
                  f"{result['sent_while_down']} ({result['refused_while_down']} refused). Back (a probe request "
                  f"sent then was served) {result['back_s']} s after the kill, served {result['served_s']} s after. "
                  f"How they ended: {_codes(result)}.", ""]
        if result.get("reload_steps"):
            steps = result["reload_steps"]
            lines += [f"The reload, in seconds after the kill: the death seen {steps['death_seen_s']}, the load "
                      f"request sent {steps['load_sent_s']}, Triton had the stage loaded {steps['loaded_s']} (its new "
                      "process's own start and load: the load timeline in the server log below), a probe served "
                      f"{result['served_s']}.", ""]
        if result["probe_errors"]:
            lines += ["Probe requests while down: " + "; ".join(f"`{message}` x {count}" for message, count
                                                                in result["probe_errors"].items()), ""]
        if result.get("other_errors"):
            lines += [f"Failed otherwise than UNAVAILABLE: {result['other_error_count']} (times in s after the "
                      "kill; the first " + f"{len(result['other_errors'])}): " + "; ".join(
                          f"#{row['index']} sent {row['sent_s']}, ended {row['ended_s']}: {row['code']} "
                          f"`{row['error']}`" for row in result["other_errors"]), ""]
        logged = result.get("reload_log", []) + result.get("server_restarts", []) + result.get("load_log", [])
        if logged:
            lines += ["Server log: " + " / ".join(f"`{line}`" for line in logged), ""]
    for note in report.get("notes", []):
        lines += [note, ""]
    return "\n".join(lines)


def write(report: dict, out_dir: Path) -> tuple[str, Path | str]:
    """results.json, results.md and soak.png (when there is a soak) into ``out_dir``: the markdown and the plot's
    path, or why there is none."""
    return write_report(report, out_dir, markdown, plot)


def plot(report: dict, out_dir: Path) -> Path | str:
    """soak.png: the soak's TTFA p50/p95 per window and each process's RSS over time."""
    result = report["scenarios"].get("soak")
    if result is None:
        return "no plot: no soak ran"
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install 'omni-triton[bench]')"
    figure, (latency, memory) = plt.subplots(1, 2, figsize=(11, 4))
    windows = result["ttfa_windows"]
    for metric, style in (("ttfa_p50_ms", "-"), ("ttfa_p95_ms", "--")):
        points = [(w["start_s"], w[metric]) for w in windows if w[metric] is not None]
        if points:
            latency.plot(*zip(*points), marker="o", linestyle=style, label=metric.removesuffix("_ms"))
    names = sorted({name for sample in result["samples"] for name in sample["processes"]})
    for name in names:
        points = [(s["t"], s["processes"][name]["rss_mib"]) for s in result["samples"]
                  if name in s["processes"] and s["processes"][name]["rss_mib"] is not None]
        if points:
            memory.plot(*zip(*points), label=name)
    latency.set_xlabel("window start (s, by send time)")
    latency.set_ylabel("TTFA (ms)")
    latency.set_ylim(bottom=0)
    memory.set_xlabel("seconds into the soak")
    memory.set_ylabel("RSS (MiB)")
    for axes in (latency, memory):
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize=7)
    figure.suptitle(f"soak: {report['label']}", fontsize=10)
    figure.tight_layout()
    path = out_dir / "soak.png"
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
