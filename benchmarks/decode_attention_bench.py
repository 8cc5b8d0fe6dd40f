"""``kernels.paged_attention.paged_decode_attention`` alone at a decode step's shapes: context splits per
(sequence, KV head) against ``decode_splits``' rule, per call, next to the KV-read floor.

    python benchmarks/decode_attention_bench.py --out-dir benchmarks/results/NAME
    python benchmarks/decode_attention_bench.py --stages talker --batches 64 --contexts 160,320,640 --splits 1,2,4,8

Per stage (the shipped full-size config's heads: talker 16 query / 2 KV heads, thinker 32 / 4, head dim 128;
pages of 16 positions), batch and context length (every sequence the same), microseconds per call at each
split count, the rule's pick marked, and the K/V bytes read per second. Each timing replays a CUDA graph of
calls that cycle through enough caches (>= 4x the L2 cache) that every call reads its K/V from HBM, as a
step's layers do. CUDA only. Writes decode_attention_bench.{json,md}.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from engine_microbench import graph_seconds_per_call, measure_ceilings
from omni_triton.kernels import paged_attention
from omni_triton.models.config import FULL_SIZE_CONFIG, OmniConfig, resolve_config_dir

PAGE = 16
L2_BYTES = 50 << 20  # the H200's L2 (60 MB on the die, 50 MB usable); caches cycle through 4x this


def decode_calls(batch: int, context: int, num_heads: int, num_kv_heads: int, head_dim: int):
    """(a function issuing one call per cache copy, calls, K/V bytes one call reads)."""
    device, dtype = torch.device("cuda"), torch.bfloat16
    pages = -(-context // PAGE)
    kv_bytes = 2 * batch * context * num_kv_heads * head_dim * dtype.itemsize
    copies = max(4, -(-4 * L2_BYTES // kv_bytes))
    gen = torch.Generator(device=device).manual_seed(0)
    caches = [torch.randn(2, batch * pages, PAGE, num_kv_heads, head_dim, device=device, dtype=dtype, generator=gen)
              for _ in range(copies)]
    tables = torch.randperm(batch * pages, device=device, generator=gen).to(torch.int32).view(batch, pages)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, num_heads, head_dim, device=device, dtype=dtype, generator=gen)

    def issue():
        for cache in caches:
            paged_attention.paged_decode_attention(q, cache, tables, lens)
    return issue, copies, kv_bytes


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stages", default="talker,thinker")
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--contexts", default="160,320,640,1280")
    parser.add_argument("--splits", default="1,2,4,8,16")
    parser.add_argument("--out-dir", default="decode_attention_bench")
    args = parser.parse_args(argv)
    config = OmniConfig.from_pretrained(resolve_config_dir(FULL_SIZE_CONFIG))
    bandwidth, _ = measure_ceilings(torch.device("cuda"))  # HBM bytes (read + written) per second
    rule = paged_attention.decode_splits
    rows, lines = [], []
    splits_list = [int(s) for s in args.splits.split(",")]
    header = "| stage | batch | context | floor us | " + " | ".join(f"{s} splits" for s in splits_list) + " |"
    lines += [f"copy bandwidth {bandwidth / 1e12:.2f} TB/s (the floor: K/V bytes at it); us per call, the rule's "
              "pick in bold, TB/s of K/V read in brackets", "", header, "|---" * (4 + len(splits_list)) + "|"]
    print(lines[0], flush=True)
    try:
        for stage in args.stages.split(","):
            text = getattr(config, stage).text
            for batch in (int(b) for b in args.batches.split(",")):
                picked = rule(batch, text.num_kv_heads)
                for context in (int(c) for c in args.contexts.split(",")):
                    issue, calls, kv_bytes = decode_calls(batch, context, text.num_heads, text.num_kv_heads,
                                                          text.head_dim)
                    cells, timings = [], {}
                    for splits in splits_list:
                        paged_attention.decode_splits = lambda *_, n=splits: n
                        seconds = graph_seconds_per_call(issue, calls)
                        timings[splits] = seconds * 1e6
                        cell = f"{seconds * 1e6:.2f} ({kv_bytes / seconds / 1e12:.2f})"
                        cells.append(f"**{cell}**" if splits == picked else cell)
                    floor = kv_bytes / bandwidth * 1e6
                    rows.append(dict(stage=stage, batch=batch, context=context, rule_splits=picked,
                                     floor_us=floor, kv_bytes=kv_bytes, us_per_call=timings))
                    lines.append(f"| {stage} | {batch} | {context} | {floor:.2f} | " + " | ".join(cells) + " |")
                    print(lines[-1], flush=True)
    finally:
        paged_attention.decode_splits = rule
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_attention_bench.json").write_text(json.dumps(dict(copy_bandwidth=bandwidth, rows=rows), indent=1))
    (out / "decode_attention_bench.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out}/decode_attention_bench.{{json,md}}")


if __name__ == "__main__":
    main()
