"""The benchmark's outputs: results.json (everything), results.md (tables), PNG plots when matplotlib is there."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path

from omni_triton.bench.metrics import RAN_DRY_S, RATIO_METRICS, LevelSummary


def machine_description() -> dict:
    """What the numbers were measured on: CPU, cores, memory, accelerator, library versions."""
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        memory_kb = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                         if line.startswith("MemTotal"))
    except (OSError, StopIteration):
        memory_kb = 0
    description = {"cpu": cpu, "cores": os.cpu_count(), "memory_gb": round(memory_kb / 2**20, 1),
                   "load_average_1m_at_start": round(os.getloadavg()[0], 2),  # other jobs on a shared machine
                   "os": platform.platform(), "python": platform.python_version()}
    try:
        import torch

        description["torch"] = torch.__version__
        if torch.cuda.is_available():
            description["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    # a copy without git history (an exported tree run on another machine) names its commit in the environment
    description["git_commit"] = os.environ.get("OMNI_TRITON_GIT_COMMIT") or _git_commit()
    return description


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def write_json(path: Path, report: dict) -> None:
    path.write_text(json.dumps(report, indent=2) + "\n")


def write_report(report: dict, out_dir: Path, markdown, plot) -> tuple[str, Path | str]:
    """A report into ``out_dir``: ``plot(report, out_dir)`` (a path, or why there is none: then a note), results.json
    (the report dict), results.md (``markdown(report)``); the markdown and what the plot returned."""
    out_dir.mkdir(parents=True, exist_ok=True)
    drawn = plot(report, out_dir)
    if isinstance(drawn, str):
        report["notes"].append(drawn)
    write_json(out_dir / "results.json", report)
    table = markdown(report)
    (out_dir / "results.md").write_text(table)
    return table, drawn


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def num(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _gpu_gib(summary: LevelSummary) -> str:
    """Peak GPU GiB of a level; with several GPUs, each one's after the sum ("112.3 (70.1 + 42.2)")."""
    total, per_gpu = num(summary.gpu_memory_peak_gib, 1), summary.gpu_memory_peak_gib_per_gpu
    return total if not per_gpu or len(per_gpu) < 2 else f"{total} ({' + '.join(num(g, 1) for g in per_gpu)})"


def workload_line(report: dict, load: str) -> str:
    """The workload every request of ``report`` ran, and how the load was offered (``load``)."""
    workload = report["workload"]
    return (f"Workload: {workload['prompt_tokens']}-token prompt ({report['prompt_ids']} ids after the chat template), "
            f"{workload['thinker_tokens']} thinker tokens, {workload['audio_frames']} audio frames "
            f"({workload['audio_frames'] / 12.5:.1f} s), greedy, IGNORE_EOS; {load}, "
            f"{workload['warmup_requests']} warm-up request(s) per system not counted.")


def markdown(report: dict, summaries: list[LevelSummary], ratios: list[dict], reference: str) -> str:
    lines = [
        f"# omni-triton benchmark: {report['label']}",
        "",
        f"Command: `{report['command']}`",
        "",
    ]
    if "merged_from" in report:  # a merge (bench/merge.py): the commands that measured the rows
        lines += ["Merged from:", ""] + [f"- `{run_dir}`: `{command}`"
                                         for run_dir, command in merged_commands(report["merged_from"])] + [""]
    lines += [
        "Machine: " + ", ".join(f"{key} {value}" for key, value in report["machine"].items()),
        "",
        workload_line(report, "closed loop"),
        "",
        "| system | conc | reqs | failed | TTFT p50 ms | TTFA p50 ms | TTFA p95 ms | TTFA p99 ms | RTF mean | RTF p95 "
        "| audio s/req | req/s | audio s/s | continuity | GPU GiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in summaries:
        lines.append(f"| {s.system} | {s.concurrency} | {s.requests} | {s.failed} | {ms(s.ttft_p50)} | "
                     f"{ms(s.ttfa_p50)} | {ms(s.ttfa_p95)} | {ms(s.ttfa_p99)} | {num(s.rtf_mean, 3)} | "
                     f"{num(s.rtf_p95, 3)} | {num(s.audio_s_per_request)} | {num(s.requests_per_s)} | {num(s.audio_s_per_s)} | "
                     f"{num(s.continuity)} | {_gpu_gib(s)} |")
    lines += listener_table(summaries)
    lines += server_cpu_table([(s.system, str(s.concurrency), s.server_cpu_pct) for s in summaries], "conc",
                              [s.server_cpu_ms_per_request for s in summaries])
    lines += triton_models_table([(s.system, str(s.concurrency), s.triton_models) for s in summaries], "conc")
    if ratios:
        lines += ["", f"Ratio to `{reference}` at the same concurrency (latency/RTF: >1 is slower; "
                      "audio s/s: <1 is less throughput):", "",
                  "| system | conc | " + " | ".join(RATIO_METRICS) + " |",
                  "|---|---:|" + "---:|" * len(RATIO_METRICS)]
        for row in ratios:
            lines.append(f"| {row['system']} | {row['concurrency']} | "
                         + " | ".join(num(row[m]) for m in RATIO_METRICS) + " |")
    errors = [(s.system, s.concurrency, e) for s in summaries for e in s.errors]
    if errors:
        lines += ["", "Errors:", ""] + [f"- {system} @ {conc}: {error}" for system, conc, error in errors]
    for note in report.get("notes", []):
        lines += ["", note]
    return "\n".join(lines) + "\n"


def listener_table(summaries: list[LevelSummary]) -> list[str]:
    """What a listener hears (benchmarks/README.md, Metrics): dry time after the first chunk, the start delay a player
    needs for gapless playback (TTFA + dry time) and the streams that ran dry (dry time > RAN_DRY_S)."""
    rows = [s for s in summaries if s.ran_dry is not None]
    if not rows:
        return []
    lines = ["", f"What a listener hears: dry time = silence after the first chunk at real-time playback; gapless "
                 f"start = TTFA + dry time; ran dry = dry time > {RAN_DRY_S * 1000:.0f} ms.", "",
             "| system | conc | dry p50 ms | dry p95 ms | gapless start p50 ms | gapless start p95 ms | ran dry "
             "| ran dry % |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for s in rows:
        lines.append(f"| {s.system} | {s.concurrency} | {ms(s.dry_p50)} | {ms(s.dry_p95)} | "
                     f"{ms(s.gapless_start_p50)} | {ms(s.gapless_start_p95)} | {s.ran_dry} | "
                     f"{num(100 * s.ran_dry_fraction, 0)} |")
    return lines


def server_cpu_table(levels: list[tuple[str, str, dict[str, float] | None]], level_name: str,
                     per_request: list[dict[str, float] | None] | None = None) -> list[str]:
    """The local server's processes' CPU per level (bench.server_cpu), from (system, level, CPU % by process) per
    level (``level_name``: what the level is, e.g. conc): a stage's stub near 100% is bound by its one Python
    thread at a time, whatever its GPU does. ``per_request``: each level's CPU ms per completed request by
    process, a second table (what bounds a stub's requests/s: 1000 / ms)."""
    lines = _process_table(levels, level_name, "Server processes' CPU during each level, % of one core (tritonserver "
                           "and each stage instance's Python stub; a stub near 100% is bound by its Python thread):", 0)
    if per_request is not None:
        lines += _process_table([(system, level, cpu) for (system, level, _), cpu in zip(levels, per_request)],
                                level_name, "Server processes' CPU per completed request, ms (a stub's one core "
                                "serves at most 1000 / ms requests/s):", 1)
    return lines


def triton_models_table(levels: list[tuple[str, str, dict[str, dict[str, float]] | None]],
                        level_name: str) -> list[str]:
    """Triton's statistics per model and level (bench.scheduler_stats), from (system, level, its summary) per
    level: requests, executions and their mean batch, and the mean ms a request spent queued in the model's
    scheduler and in the backend (compute: a Python-backend model's execute)."""
    rows = [(system, level, name, model) for system, level, models in levels if models
            for name, model in models.items()]
    if not rows:
        return []
    lines = ["", "Triton's statistics per model during each level (BLS requests between stages included; queue: "
                 "arrival -> handed to the backend; compute: the backend's execute of it; means per request):", "",
             f"| system | {level_name} | model | requests | executions | batch mean | queue ms | compute ms |",
             "|---|---:|---|---:|---:|---:|---:|---:|"]
    for system, level, name, model in rows:
        lines.append(f"| {system} | {level} | {name} | {model['requests']} | {model['executions']} | "
                     f"{num(model['batch_mean'], 2)} | {num(model['queue_ms'], 2)} | {num(model['compute_ms'], 2)} |")
    return lines


def _process_table(levels: list[tuple[str, str, dict[str, float] | None]], level_name: str, title: str,
                   digits: int) -> list[str]:
    rows = [(system, level, cpu) for system, level, cpu in levels if cpu]
    if not rows:
        return []
    names = sorted({name for _, _, cpu in rows for name in cpu}, key=lambda name: (name != "tritonserver", name))
    lines = ["", title, "", f"| system | {level_name} | " + " | ".join(names) + " |",
             "|---|---:|" + "---:|" * len(names)]
    for system, level, cpu in rows:
        lines.append(f"| {system} | {level} | " + " | ".join(num(cpu.get(name), digits) for name in names) + " |")
    return lines


def merged_commands(merged_from: list[dict]) -> list[tuple[str, str]]:
    """(dir, command) of every run that went into a merged report, a merge of merges included."""
    found = []
    for entry in merged_from:
        found += (merged_commands(entry["merged_from"]) if "merged_from" in entry
                  else [(entry["dir"], entry["command"])])
    return found


# filename -> ((metric, legend suffix), ...), y label, scale from the summary's unit
CHARTS = {
    "ttfa.png": ((("ttfa_p50", "p50"), ("ttfa_p95", "p95")), "TTFA (ms)", 1000),
    "throughput.png": ((("requests_per_s", ""),), "requests / second (fixed audio length each)", 1),
    "gapless_start.png": ((("gapless_start_p50", "p50"), ("gapless_start_p95", "p95")),
                          "gapless start delay: TTFA + dry time (ms)", 1000),
    "ran_dry.png": ((("ran_dry_fraction", ""),), f"streams that ran dry (> {RAN_DRY_S * 1000:.0f} ms), %", 100),
}


def plot(summaries: list[LevelSummary], out_dir: Path) -> list[Path] | str:
    """The CHARTS vs concurrency, one line per system; a message instead when matplotlib is not installed
    (pip install 'omni-triton[bench]')."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plots skipped: matplotlib is not installed (pip install 'omni-triton[bench]')"
    systems = list(dict.fromkeys(s.system for s in summaries))
    paths = []
    for filename, (metrics, label, scale) in CHARTS.items():
        figure, axes = plt.subplots(figsize=(6, 4))
        for index, system in enumerate(systems):
            rows = [s for s in summaries if s.system == system]
            for metric, suffix in metrics:
                points = [(s.concurrency, getattr(s, metric)) for s in rows if getattr(s, metric) is not None]
                if not points:
                    continue
                x, y = zip(*points)
                axes.plot(x, [v * scale for v in y], marker="o", color=f"C{index}",
                          linestyle="-" if suffix in ("", "p50") else "--", label=f"{system} {suffix}".strip())
        if not axes.get_lines():  # e.g. no system returned audio: no listener chart
            plt.close(figure)
            continue
        levels = sorted({s.concurrency for s in summaries})
        values = [v for line in axes.get_lines() for v in line.get_ydata() if v > 0]
        # e.g. a non-streaming baseline 100x the others; a fraction stays linear
        if filename != "ran_dry.png" and values and max(values) > 30 * min(values):
            axes.set_yscale("log")
        axes.set_xscale("log", base=2)
        axes.set_xticks(levels, [str(c) for c in levels])
        axes.set_xlabel("concurrency")
        axes.set_ylabel(label)
        axes.grid(True, alpha=0.3)
        axes.legend(fontsize=8)
        figure.tight_layout()
        figure.savefig(out_dir / filename, dpi=100)
        plt.close(figure)
        paths.append(out_dir / filename)
    return paths
