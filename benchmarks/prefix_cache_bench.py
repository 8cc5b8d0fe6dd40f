"""Prefix caching's two workloads (issue 46), against a served pipeline with the cache on and off:

- conversation: a five-turn conversation with a long system prompt, each turn's prompt = the last one + its reply
  + a new user turn; the TTFA of every turn (cached, a later turn pays only for its new tokens);
- shared prompt: concurrent requests that share one system prompt, each with its own question; TTFA p50 and
  requests/s.

Prompts are made here (the ``omni`` model takes one user turn): token ids sent straight to the orchestrator,
rendered with the checkpoint's chat template. Fixed lengths: IGNORE_EOS, greedy, MIN = MAX tokens and frames. The
prefix-cache gauges (docs/prefix_caching.md) are read from the metrics port around each workload.

    # a served pipeline (omni-triton serve ... --prefix-caching on|off): one run per setting, then compare
    python benchmarks/prefix_cache_bench.py --url 127.0.0.1:8001 --metrics-url http://127.0.0.1:8002/metrics \\
        --checkpoint CKPT --label on --out on.json
    python benchmarks/prefix_cache_bench.py --compare on.json off.json --out compare.json  # ratios, tables
    # CPU: the tiny checkpoint served twice here, off then on, and the ratios side by side
    python benchmarks/prefix_cache_bench.py --tiny --system-tokens 200 --turn-tokens 40 --concurrency 4
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from omni_triton.client import OmniStreamClient, build_inputs, infer_inputs
from omni_triton.pipeline.chat import ChatTokenizer
from omni_triton.stages.orchestrator import REQUEST_INPUTS

WORDS = "the quick brown fox jumps over a lazy dog while seven patient birds sing about rivers and stones".split()


def text_of_tokens(chat: ChatTokenizer, tokens: int, seed: int) -> str:
    """Words (a seeded shuffle, so prompts differ) until the text is ``tokens`` tokens long."""
    rng = np.random.default_rng(seed)
    words = []
    while len(chat.tokenizer.encode(" ".join(words)).ids) < tokens:
        words.append(WORDS[rng.integers(len(WORDS))])
    return " ".join(words)


def output_digest(result) -> dict:
    """What a reply said and sounded like, short: cache on and off compare these (no output change)."""
    audio = np.ascontiguousarray(result.audio, np.float32)
    return {"text": hashlib.sha256(result.text.encode()).hexdigest()[:16],
            "audio": hashlib.sha256(audio.tobytes()).hexdigest()[:16], "audio_samples": int(audio.size)}


def message(role: str, text: str) -> dict:
    return {"role": role, "content": [{"type": "text", "text": text}]}


class Served:
    def __init__(self, url: str, metrics_url: str | None, max_tokens: int, audio_frames: int):
        self.url, self.metrics_url = url, metrics_url
        scalars = dict(max_tokens=max_tokens, min_tokens=max_tokens, max_audio_frames=audio_frames,
                       min_audio_frames=audio_frames, ignore_eos=True, temperature=0.0, seed=0)
        with grpcclient.InferenceServerClient(url) as client:
            prepared = client.infer("preprocess", build_inputs("x", **scalars))
        self.arrays = {name: prepared.as_numpy(name) for name in REQUEST_INPUTS if name not in ("INPUT_IDS", "CONTROL")}

    def send(self, prompt_ids: list[int]):
        arrays = dict(self.arrays, INPUT_IDS=np.asarray(prompt_ids, np.int64))
        with OmniStreamClient(self.url, model="orchestrator") as client:
            return client.stream_inputs(infer_inputs(arrays), timeout_s=600)

    def gauges(self) -> dict[str, float]:
        """The prefix-cache gauges by "name{stage}" (empty without a metrics URL)."""
        if not self.metrics_url:
            return {}
        text = urllib.request.urlopen(self.metrics_url, timeout=10).read().decode()
        return {f"{name}{{{stage}}}": float(value) for name, stage, value in
                re.findall(r'^(omni_prefix_cache_\w+)\{stage="(\w+)"[^}]*\} (\S+)$', text, re.M)}


def conversation(served: Served, chat: ChatTokenizer, args) -> dict:
    system = message("system", text_of_tokens(chat, args.system_tokens, seed=0))
    messages, turns = [system], []
    before = served.gauges()
    for turn in range(args.turns):
        messages.append(message("user", text_of_tokens(chat, args.turn_tokens, seed=100 + turn)))
        ids = chat.encode_messages(messages)
        result = served.send(ids)
        turns.append({"turn": turn + 1, "prompt_tokens": len(ids), "ttfa_s": result.ttfa_s, "ttft_s": result.ttft_s,
                      "output": output_digest(result)})
        messages.append(message("assistant", result.text))
    return {"turns": turns, "turn_ttfa_ratio": turns[-1]["ttfa_s"] / turns[0]["ttfa_s"],
            "gauges": _delta(before, served.gauges())}


def shared_prompt(served: Served, chat: ChatTokenizer, args) -> dict:
    system = message("system", text_of_tokens(chat, args.system_tokens, seed=1))
    prompts = [chat.encode_messages([system, message("user", text_of_tokens(chat, args.question_tokens, seed=200 + i))])
               for i in range(args.requests)]
    before = served.gauges()
    start = time.monotonic()
    with ThreadPoolExecutor(args.concurrency) as pool:
        results = list(pool.map(served.send, prompts))
    wall = time.monotonic() - start
    ttfa = [r.ttfa_s for r in results if r.ttfa_s is not None]
    return {"requests": len(prompts), "concurrency": args.concurrency, "ttfa_p50_s": statistics.median(ttfa),
            "requests_per_s": len(prompts) / wall, "gauges": _delta(before, served.gauges()),
            "outputs": [output_digest(result) for result in results]}


def _delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Counters as the workload's increase; the hit rate and cached blocks as they are after it."""
    return {key: value - before.get(key, 0.0) if key.split("{")[0].endswith(("_tokens", "_evictions")) else value
            for key, value in after.items()}


def run(served: Served, chat: ChatTokenizer, args) -> dict:
    served.send(chat.encode_messages([message("user", "warm up")]))  # first-use costs out of the numbers
    return {"conversation": conversation(served, chat, args), "shared_prompt": shared_prompt(served, chat, args)}


def tiny_side_by_side(args) -> dict:
    """Two servers of the tiny checkpoint (CPU), cache off then on, the same workloads on each."""
    from omni_triton.checkpoints.tiny import build
    from omni_triton.launch.repository import render_repository
    from omni_triton.shared.settings import LaunchConfig
    from omni_triton.launch.tritonserver import ServerOptions, TritonServer, find_tritonserver, free_port

    work = Path(tempfile.mkdtemp(prefix="prefix-cache-bench-"))
    checkpoint = build(work / "tiny")
    chat = ChatTokenizer.from_checkpoint(checkpoint)
    report = {}
    for caching in (False, True):
        config = LaunchConfig(checkpoint_dir=checkpoint, prefix_caching=caching, kv_cache_tokens=8192)
        repository = render_repository(config, work / f"repository-{caching}")
        options = ServerOptions(http_port=free_port(), grpc_port=free_port(), metrics_port=free_port())
        server = TritonServer(repository, find_tritonserver(), options, log_path=work / f"server-{caching}.log")
        server.start()
        try:
            server.wait_ready(timeout_s=300)
            served = Served(server.grpc_url, server.metrics_url, args.max_tokens, args.audio_frames)
            report["on" if caching else "off"] = run(served, chat, args)
        finally:
            server.stop()
    report["ratios_on_to_off"] = ratios_on_to_off(report["on"], report["off"])
    return report


def same_outputs(on: dict, off: dict) -> dict:
    """Replies whose text / audio are bit-identical with the cache on and off, of those both runs made. A later
    conversation turn's prompt holds the earlier replies, so one differing reply changes every later prompt."""
    pairs = {"conversation": [(a.get("output"), b.get("output")) for a, b in zip(on["conversation"]["turns"],
                                                                                 off["conversation"]["turns"])],
             "shared_prompt": list(zip(on["shared_prompt"].get("outputs", []), off["shared_prompt"].get("outputs", [])))}
    return {workload: {"compared": sum(1 for a, b in pairs_ if a and b),
                       **{what: sum(1 for a, b in pairs_ if a and b and a[what] == b[what]) for what in ("text", "audio")}}
            for workload, pairs_ in pairs.items()}


def ratios_on_to_off(on: dict, off: dict) -> dict:
    return {
        "same_outputs": same_outputs(on, off),
        "conversation_turn_ttfa": [a["ttfa_s"] / b["ttfa_s"] for a, b in zip(on["conversation"]["turns"],
                                                                              off["conversation"]["turns"])],
        "shared_prompt_ttfa_p50": on["shared_prompt"]["ttfa_p50_s"] / off["shared_prompt"]["ttfa_p50_s"],
        "shared_prompt_requests_per_s": on["shared_prompt"]["requests_per_s"] / off["shared_prompt"]["requests_per_s"],
    }


def compare_runs(on_path: Path, off_path: Path) -> dict:
    """Two --url runs' reports (cache on, cache off) side by side, with the same ratios as --tiny."""
    (on,), (off,) = (json.loads(Path(path).read_text()).values() for path in (on_path, off_path))
    return {"on": on, "off": off, "ratios_on_to_off": ratios_on_to_off(on, off)}


def markdown(report: dict) -> str:
    """The issue's figures (TTFA per turn, turn 5 / turn 1, shared-prompt TTFA p50 and requests/s) as tables."""
    on, off, ratios = report["on"], report["off"], report["ratios_on_to_off"]
    lines = ["| turn | prompt tokens | TTFA on ms | TTFA off ms | on / off |", "|---:|---:|---:|---:|---:|"]
    for a, b, ratio in zip(on["conversation"]["turns"], off["conversation"]["turns"], ratios["conversation_turn_ttfa"]):
        lines.append(f"| {a['turn']} | {a['prompt_tokens']} | {a['ttfa_s'] * 1000:.0f} | {b['ttfa_s'] * 1000:.0f} "
                     f"| {ratio:.2f} |")
    lines.append(f"\nlast turn / first turn TTFA: on {on['conversation']['turn_ttfa_ratio']:.2f}, "
                 f"off {off['conversation']['turn_ttfa_ratio']:.2f}\n")
    shared_on, shared_off = on["shared_prompt"], off["shared_prompt"]
    lines += [f"shared prompt, {shared_on['requests']} requests at {shared_on['concurrency']} concurrent:", "",
              "| | on | off | on / off |", "|---|---:|---:|---:|",
              f"| TTFA p50 ms | {shared_on['ttfa_p50_s'] * 1000:.0f} | {shared_off['ttfa_p50_s'] * 1000:.0f} "
              f"| {ratios['shared_prompt_ttfa_p50']:.2f} |",
              f"| requests/s | {shared_on['requests_per_s']:.2f} | {shared_off['requests_per_s']:.2f} "
              f"| {ratios['shared_prompt_requests_per_s']:.2f} |", "",
              "replies identical with the cache on and off (text, audio / compared; the shared-prompt requests run "
              "concurrently, and a batch of another make-up rounds differently in any two runs): " + "; ".join(
                  f"{workload} {same['text']}, {same['audio']} / {same['compared']}"
                  for workload, same in ratios["same_outputs"].items()), "",
              "cache on, hit / query tokens per stage: " + "; ".join(
                  f"{workload} {_hits(on[workload]['gauges'])}" for workload in ("conversation", "shared_prompt"))]
    return "\n".join(lines) + "\n"


def _hits(gauges: dict[str, float]) -> str:
    return ", ".join(f"{stage} {gauges.get(f'omni_prefix_cache_hit_tokens{{{stage}}}', 0):.0f} / "
                     f"{gauges.get(f'omni_prefix_cache_query_tokens{{{stage}}}', 0):.0f}"
                     for stage in ("thinker", "talker"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="a served pipeline's gRPC address (needs --checkpoint)")
    target.add_argument("--tiny", action="store_true", help="serve the tiny checkpoint here, off then on (CPU)")
    target.add_argument("--compare", nargs=2, type=Path, metavar=("ON_JSON", "OFF_JSON"),
                        help="two --url runs' reports (cache on, then off): side by side, ratios and tables")
    parser.add_argument("--metrics-url", help="its metrics, e.g. http://127.0.0.1:8002/metrics")
    parser.add_argument("--checkpoint", type=Path, help="the served checkpoint (its tokenizer and chat template)")
    parser.add_argument("--label", default="run", help="the run's name in the report (e.g. on, off)")
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--turn-tokens", type=int, default=200)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--question-tokens", type=int, default=50)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=64, help="shared-prompt requests in all")
    parser.add_argument("--max-tokens", type=int, default=20, help="thinker tokens per request (the reply)")
    parser.add_argument("--audio-frames", type=int, default=25)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.compare:
        report = compare_runs(*args.compare)
        print(markdown(report))
        if args.out:
            args.out.write_text(json.dumps(report, indent=2) + "\n")
        return 0
    if args.tiny:
        report = tiny_side_by_side(args)
    else:
        if args.checkpoint is None:
            parser.error("--url needs --checkpoint")
        served = Served(args.url, args.metrics_url, args.max_tokens, args.audio_frames)
        report = {args.label: run(served, ChatTokenizer.from_checkpoint(args.checkpoint), args)}
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
