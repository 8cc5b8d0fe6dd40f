"""Pick ``fused_moe``'s block sizes on this GPU, per token-count bucket, and write them as JSON.

    python -m omni_triton.bench.tune_fused_moe --out fused_moe_configs.json   # then merge into the package's
    python -m omni_triton.bench.tune_fused_moe --stages talker --buckets 16,64 --wide --out talker.json

The shapes are the MoE layers of the shipped full-size config (thinker and talker). Each candidate is timed as
CUDA-graph replays of the whole fused MoE over ``LAYERS`` different weight copies in a row, so nothing stays
in L2 between calls (as in a real forward) and host launch cost is out of the numbers. Coordinate search: the
gate/up GEMM's tiles first (down at its default), then the down GEMM's, for each ``BLOCK_M`` that fits the
bucket. At decode sizes (up to ``GEMV_MAX_TOKENS``) each line also gives the per-pair GEMVs' time, measured the
same way, beside the grouped GEMMs'.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
import triton.testing

from omni_triton.kernels.fused_moe import GEMV_MAX_TOKENS, default_config, fused_experts, shape_key
from omni_triton.kernels.routing import route
from omni_triton.models.config import FULL_SIZE_CONFIG, OmniConfig, resolve_config_dir

BUCKETS = (1, 4, 16, 64, 256, 2048)
LAYERS = 4
GEMM_CANDIDATES = [dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s)
                   for n, k, w, s in ((32, 128, 4, 4), (64, 128, 4, 4), (64, 256, 4, 3), (128, 128, 4, 3),
                                      (128, 64, 8, 4), (128, 128, 8, 3))]
# --wide adds these: deeper pipelines and longer K steps, more weight bytes in flight per program (the talker's
# experts at 64 tokens read ~290 MB a layer at ~3.4 TB/s with the six above)
WIDE_CANDIDATES = [dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=s)
                   for n, k, w, s in ((32, 128, 4, 6), (32, 256, 4, 4), (64, 128, 4, 6), (64, 256, 8, 4),
                                      (16, 256, 4, 4), (16, 128, 2, 6))]


def block_m_candidates(num_tokens: int, top_k: int, num_experts: int) -> list[int]:
    pairs_per_expert = num_tokens * top_k / num_experts
    return [16] if pairs_per_expert <= 8 else [32, 64] if pairs_per_expert <= 48 else [64, 128]


def tune_shape(num_experts: int, hidden: int, inter: int, top_k: int, dtype: torch.dtype,
               table: dict[str, dict], save, buckets=BUCKETS, candidates=GEMM_CANDIDATES) -> None:
    """Fills ``table`` bucket by bucket, calling ``save()`` after each (a cut-short run keeps what it found)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    gate_ups = [torch.randn(num_experts, 2 * inter, hidden, device="cuda", dtype=dtype, generator=gen) * hidden ** -0.5
                for _ in range(LAYERS)]
    downs = [torch.randn(num_experts, hidden, inter, device="cuda", dtype=dtype, generator=gen) * inter ** -0.5
             for _ in range(LAYERS)]
    for num_tokens in buckets:
        x = torch.randn(num_tokens, hidden, device="cuda", dtype=dtype, generator=gen)
        logits = torch.randn(num_tokens, num_experts, device="cuda", dtype=dtype, generator=gen)
        weights, ids = route(logits, top_k, True)

        def ms(config, gemv=False):
            def layers():
                for gate_up, down in zip(gate_ups, downs):
                    fused_experts(x, gate_up, down, ids, weights, config, gemv=gemv)
            try:
                layers()
            except triton.runtime.errors.OutOfResources:  # tiles that do not fit in shared memory
                return float("inf")
            return triton.testing.do_bench_cudagraph(layers, rep=50) / LAYERS

        best = None
        for block_m in block_m_candidates(num_tokens, top_k, num_experts):
            config = dict(default_config(num_tokens), BLOCK_M=block_m)
            for part in ("gate_up", "down"):
                timed = [(ms(dict(config, **{part: gemm})), gemm) for gemm in candidates]
                config[part] = min(timed, key=lambda t: t[0])[1]
            took = ms(config)
            if best is None or took < best[0]:
                best = (took, config)
        # the decode sizes' per-pair GEMVs (what --linear-launch gemv runs there) beside the grouped GEMMs
        by_pair = f", per-pair GEMVs {ms(None, gemv=True) * 1e3:.1f}" if num_tokens <= GEMV_MAX_TOKENS else ""
        print(f"E{num_experts} H{hidden} I{inter} k{top_k} tokens {num_tokens}: {best[0] * 1e3:.1f} us/layer "
              f"(default {ms(default_config(num_tokens)) * 1e3:.1f}{by_pair}) {best[1]}", flush=True)
        table[str(num_tokens)] = best[1]
        save()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=FULL_SIZE_CONFIG)
    parser.add_argument("--out", default="fused_moe_configs.json")
    parser.add_argument("--stages", default="thinker,talker", help="whose MoE shapes to tune (comma list)")
    parser.add_argument("--buckets", default=",".join(map(str, BUCKETS)),
                        help="token-count buckets to tune (comma list; the table keeps these only)")
    parser.add_argument("--wide", action="store_true", help="also try WIDE_CANDIDATES (longer run)")
    args = parser.parse_args(argv)
    stages = args.stages.split(",")
    if not stages or set(stages) - {"thinker", "talker"}:
        parser.error(f"--stages: thinker and/or talker, got {args.stages!r}")
    buckets = [int(b) for b in args.buckets.split(",")]
    candidates = GEMM_CANDIDATES + (WIDE_CANDIDATES if args.wide else [])
    config = OmniConfig.from_pretrained(resolve_config_dir(args.config))
    out = Path(args.out)
    table = json.loads(out.read_text()) if out.is_file() else {}
    tuned = table[torch.cuda.get_device_name()] = {}

    def save():
        out.write_text(json.dumps(table, indent=1) + "\n")

    for stage in stages:
        text = getattr(config, stage).text
        shape = tuned[shape_key(text.num_experts, text.hidden_size, text.moe_intermediate_size)] = {}
        tune_shape(text.num_experts, text.hidden_size, text.moe_intermediate_size, text.num_experts_per_tok,
                   torch.bfloat16, shape, save, buckets, candidates)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
