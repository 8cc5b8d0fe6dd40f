"""The open loop's report: results.md's tables (per rate, goodput; with --trace, the closed loop's TTFA breakdown
a column per rate) and open_loop.png (TTFA and completed requests/s against the offered rate). results.json is the
report dict itself (bench/open_loop_cli.py)."""

from __future__ import annotations

import json
from pathlib import Path

from omni_triton.bench import breakdown
from omni_triton.bench.metrics import RAN_DRY_S
from omni_triton.bench.open_loop import arrivals_line
from omni_triton.bench.report import (merged_commands, ms, num, server_cpu_table, triton_models_table, workload_line,
                                      write_report)


def goodput_line(goodput: dict, mix: bool = False) -> str:
    limit_ms = goodput["ttfa_p95_limit_s"] * 1000
    rate = goodput["requests_per_s"]
    found = "none of the rates tried passed" if rate is None else f"**{rate:g} requests/s**"
    how = (f"search from {goodput['search']['start']:g}/s, doubling then {goodput['search']['bisections']} "
           "bisection step(s)" if goodput.get("search") else "the highest passing rate of the list")
    return (f"Goodput: {found} ({how}; a rate passes with TTFA p95 <= {limit_ms:.0f} ms, no stream dry "
            f"(> {RAN_DRY_S * 1000:.0f} ms), none failed or unsent"
            + (", the mix's requests cancelled or expired as meant excepted" if mix else "") + "). Rates tried: "
            + ", ".join(f"{rate:g} {'pass' if ok else 'fail'}" for rate, ok in goodput["tried"]) + ".")


def mix_line(report: dict, load: str) -> str:
    """The soak's request mix every request of ``report`` was drawn from (``--mix``), and how the load was
    offered (``load``)."""
    return (f"Workload: the soak's request mix `{json.dumps(report['open_loop']['mix'])}` (every request "
            f"fixed-length, IGNORE_EOS; the soak's own requests in its order); {load}, "
            f"{report['workload']['warmup_requests']} warm-up request(s) of the mix not counted.")


def markdown(report: dict) -> str:
    open_loop = report["open_loop"]
    rows = sorted(report["rates"], key=lambda row: (row["system"], row["rate"]))  # a search's in rate order
    lines = [
        f"# omni-triton open-loop benchmark: {report['label']}",
        "",
        f"Command: `{report['command']}`",
        "",
    ]
    if "merged_from" in report:  # bench --merge of open-loop runs: the commands that measured the rates
        lines += ["Merged from:", ""] + [f"- `{run_dir}`: `{command}`"
                                         for run_dir, command in merged_commands(report["merged_from"])] + [""]
    lines += [
        "Machine: " + ", ".join(f"{key} {value}" for key, value in report["machine"].items()),
        "",
        (mix_line if "mix" in open_loop else workload_line)(
            report, "open loop: random arrivals (below) over "
                    f"{open_loop['duration_s']:g} s per rate (arrival seed {open_loop['arrival_seed']}), "
                    "each request on its own gRPC stream"),
        "",
        arrivals_line(open_loop),
        "",
        goodput_line(report["goodput"], "mix" in open_loop),
        "",
        "| system | rate /s | achieved /s | sent | completed | failed | late starts | peak in flight | TTFT p50 ms "
        "| TTFA p50 ms | TTFA p95 ms | TTFA p99 ms | dry p95 ms | ran dry | req/s | audio s/s | RTF mean | GPU GiB "
        "| passes |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        failed = sum(row["failed_by_code"].values()) + row["not_started"]
        lines.append(
            f"| {row['system']} | {row['rate']:g} | {row['achieved_rate']:.2f} | {row['sent']} | {row['completed']} | "
            f"{failed} | {row['late_starts']} | {row['concurrency']} | {ms(row['ttft_p50'])} | "
            f"{ms(row['ttfa_p50'])} | {ms(row['ttfa_p95'])} | {ms(row['ttfa_p99'])} | {ms(row['dry_p95'])} | "
            f"{'-' if row['ran_dry'] is None else row['ran_dry']} | {num(row['requests_per_s'])} | "
            f"{num(row['audio_s_per_s'])} | {num(row['rtf_mean'], 3)} | {num(row['gpu_memory_peak_gib'], 1)} | "
            f"{'yes' if row['passes'] else 'no: ' + row['verdict']} |")
    lines += ["", "rate: named (exact arrivals offer it, rounded to whole arrivals; poisson ones, as their mean); "
                  "achieved: requests sent / duration (what this sample of arrivals offered); failed: by error "
                  "code below, plus arrivals not sent at the client's in-flight cap "
                  f"(--max-client-streams {open_loop['max_client_streams']}); late starts: sent > "
                  f"{open_loop['late_start_s'] * 1000:.0f} ms after their arrival time (the client fell behind); "
                  "peak in flight: most requests running at once; req/s, audio s/s: completed requests over the "
                  "time from the rate's start to its last request's end (the drain included)."]
    if "mix" in open_loop:
        lines += ["", "Ended as meant (the mix's requests the client cancelled or whose deadline expired, failed so: "
                      "not failures, not in the metrics): " + "; ".join(
                          f"{row['rate']:g}/s: {row.get('ended_as_meant', 0)}" for row in rows) + "."]
    lines += server_cpu_table([(row["system"], f"{row['rate']:g}/s", row["server_cpu_pct"]) for row in rows], "rate",
                              [row.get("server_cpu_ms_per_request") for row in rows])
    lines += triton_models_table([(row["system"], f"{row['rate']:g}/s", row.get("triton_models")) for row in rows],
                                 "rate")
    failures = [(row["system"], row["rate"], code, count) for row in report["rates"]
                for code, count in row["failed_by_code"].items()]
    failures += [(row["system"], row["rate"], "not sent (client cap)", row["not_started"])
                 for row in report["rates"] if row["not_started"]]
    if failures:
        lines += ["", "Failed by code:", ""] + [f"- {system} @ {rate:g}/s: {code} x {count}"
                                               for system, rate, code, count in failures]
    errors = [(row["system"], row["rate"], error) for row in report["rates"] for error in row["errors"]]
    if errors:
        lines += ["", "Errors:", ""] + [f"- {system} @ {rate:g}/s: {error}" for system, rate, error in errors]
    for note in report.get("notes", []):
        lines += ["", note]
    # a search tries its rates out of order: the columns go in rate order, as the rows above
    traced = sorted(report.get("ttfa_breakdown", []), key=lambda row: (row["system"], row["rate"]))
    return "\n".join(lines) + "\n" + breakdown.report_section(traced)


def write(report: dict, out_dir: Path) -> tuple[str, Path | str]:
    """results.json (with a note when the plot could not be drawn), results.md and open_loop.png into
    ``out_dir``; the markdown and the plot's path (or why there is none)."""
    return write_report(report, out_dir, markdown, plot)


def plot(report: dict, out_dir: Path) -> Path | str:
    """open_loop.png: TTFA p50/p95 (with the goodput limit) and completed requests/s (with the offered rate)
    against the offered rate, one colour per system; a message instead when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install 'omni-triton[bench]')"
    rows = report["rates"]
    figure, (latency, throughput) = plt.subplots(1, 2, figsize=(11, 4))
    for index, system in enumerate(dict.fromkeys(row["system"] for row in rows)):
        mine = sorted((row for row in rows if row["system"] == system), key=lambda row: row["rate"])
        rates = [row["rate"] for row in mine]
        for metric, style in (("ttfa_p50", "-"), ("ttfa_p95", "--")):
            points = [(row["rate"], row[metric] * 1000) for row in mine if row[metric] is not None]
            if points:
                latency.plot(*zip(*points), marker="o", color=f"C{index}", linestyle=style,
                             label=f"{system} {metric.removeprefix('ttfa_')}")
        failing = [(row["rate"], row["ttfa_p95"] * 1000) for row in mine
                   if not row["passes"] and row["ttfa_p95"] is not None]
        if failing:  # dry streams or failures fail a rate whatever its TTFA: say which did
            latency.plot(*zip(*failing), marker="x", markersize=10, color="red", linestyle="",
                         label=f"{system} fails (see verdict)")
        throughput.plot(rates, [row["requests_per_s"] for row in mine], marker="o", color=f"C{index}",
                        label=f"{system} completed")
        throughput.plot(rates, [row["achieved_rate"] for row in mine], marker="x", color=f"C{index}", linestyle="",
                        label=f"{system} sent (achieved arrivals)")
    goodput = report["goodput"]
    latency.axhline(goodput["ttfa_p95_limit_s"] * 1000, color="grey", linestyle=":", label="p95 limit")
    offered = sorted({row["rate"] for row in rows})
    throughput.plot(offered, offered, color="grey", linestyle=":", label="offered")
    if goodput["requests_per_s"] is not None:
        for axes in (latency, throughput):
            axes.axvline(goodput["requests_per_s"], color="green", alpha=0.5, label="goodput")
    latency.set_ylim(bottom=0)
    latency.set_ylabel("TTFA (ms)")
    throughput.set_ylabel("completed requests / second")
    for axes in (latency, throughput):
        axes.set_xlabel("offered rate (requests / second)")
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize=8)
    figure.suptitle(f"open loop: {report['label']}", fontsize=10)
    figure.tight_layout()
    path = out_dir / "open_loop.png"
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path
