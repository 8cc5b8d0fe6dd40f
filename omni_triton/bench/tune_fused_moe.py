"""Pick ``fused_moe``'s block sizes on this GPU, per token-count bucket, and write them as JSON.

    python -m omni_triton.bench.tune_fused_moe --out fused_moe_configs.json   # then merge into the package's
    python -m omni_triton.bench.tune_fused_moe --stages talker --buckets 16,64 --wide --out talker.json
    python -m omni_triton.bench.tune_fused_moe --quantization fp8 --stages thinker --tokens 1,16,32,64,128 \\
        --budget-s 200 --out omni_triton/kernels/fused_moe_configs.json

The shapes are the MoE layers of the shipped full-size config (thinker and talker), with seeded random weights
made on the GPU (``--quantization fp8``: rounded to block FP8 as ``--quantization fp8`` serves them, with entries
of their own in the table: ``fused_moe.shape_key``). Each candidate is timed as CUDA-graph replays of the whole
fused MoE over ``LAYERS`` different weight copies in a row, so nothing stays in L2 between calls (as in a real
forward) and host launch cost is out of the numbers. The output file is merged into: other devices' and other
shapes' entries stay; a tuned shape's buckets are replaced.

bf16: coordinate search, the gate/up GEMM's tiles first (down at its default), then the down GEMM's, for each
``BLOCK_M`` that fits the bucket. FP8 (``fp8_search``): at a decode step's few pairs per expert the grouped GEMMs
are bound by the instructions spent per weight byte (each weight converted before the tensor cores take it), so
per ``BLOCK_M`` and per GEMM: every tile shape of ``FP8_TILES`` at 3 stages, then the best at other depths, then
the best with the scales on the weights (``SCALE_AFTER_DOT`` off, the torch path's rounding), kept if faster. Each
bucket prints every timing as it goes, then a table: the best config per bucket, its time a layer, the expert
weight bytes it read per second against ``--peak-gbs``, the size rule's time, and the programs each GEMM launched
(against the GPU's multiprocessors). The picked config is checked against the torch path (``run_experts`` on the
dequantized weights) before it is written; ``--budget-s`` bounds the search (each bucket gets its share; a bucket
past its share keeps the best found so far).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import time
from pathlib import Path

import torch
import triton
import triton.testing

from omni_triton.kernels.fused_moe import GEMV_MAX_TOKENS, default_config, e4m3_as_bf16, fused_experts, shape_key
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
# FP8 tiles (BLOCK_N, BLOCK_K, num_warps): K tiles inside one 128-wide block of scales; then these depths
FP8_TILES = [(n, k, w) for n in (64, 128, 256) for k in (64, 128) for w in (4, 8)]
FP8_STAGES = (2, 3, 4, 5)
SHARED_MEMORY_BYTES = 227 * 1024  # an sm_90 program's most; deeper tiles are skipped before they compile
FP8_BLOCK = (128, 128)


def block_m_candidates(num_tokens: int, top_k: int, num_experts: int) -> list[int]:
    pairs_per_expert = num_tokens * top_k / num_experts
    return [16] if pairs_per_expert <= 8 else [32, 64] if pairs_per_expert <= 48 else [64, 128]


def fp8_block_m_candidates(num_tokens: int, top_k: int, num_experts: int) -> list[int]:
    """16 rows while most experts get one or two pairs; 32 and 64 too once an expert's pairs can pass 16 (a
    second block of the same expert reads its weights again)."""
    pairs_per_expert = num_tokens * top_k / num_experts
    return [16] if pairs_per_expert < 2 else [16, 32] if pairs_per_expert < 8 else [16, 32, 64]


def fp8_shared_bytes(part: str, block_m: int, gemm: dict) -> int:
    """Shared memory of one program's pipeline: each stage an activation tile (bf16) and one or two weight
    tiles (FP8; gate and up)."""
    weight_tiles = 2 if part == "gate_up" else 1
    per_stage = block_m * gemm["BLOCK_K"] * 2 + weight_tiles * gemm["BLOCK_K"] * gemm["BLOCK_N"]
    return gemm["num_stages"] * per_stage


def expert_weights(num_experts: int, hidden: int, inter: int, fp8: bool, gen: torch.Generator,
                   dtype: torch.dtype, block: tuple[int, int], copies: int | None = None) -> list[tuple]:
    """``copies`` (``LAYERS``) copies of random experts on ``gen``'s device: (gate_up, down, fp8_scales or None)."""
    from omni_triton.models.quantization import quantize_fp8

    layers = []
    for _ in range(LAYERS if copies is None else copies):
        gate_up = torch.randn(num_experts, 2 * inter, hidden, device=gen.device, dtype=dtype, generator=gen)
        down = torch.randn(num_experts, hidden, inter, device=gen.device, dtype=dtype, generator=gen)
        gate_up, down = gate_up * hidden ** -0.5, down * inter ** -0.5
        if not fp8:
            layers.append((gate_up, down, None))
            continue
        # the gate and up halves blocked apart (Fp8Experts' layout) equal one [2I, H] blocking when the block divides I
        if inter % block[0]:
            raise ValueError(f"--quantization fp8: intermediate size {inter} is not a multiple of {block[0]}")
        (gate_up, gate_up_scales), (down, down_scales) = quantize_fp8(gate_up, block), quantize_fp8(down, block)
        layers.append((gate_up, down, (gate_up_scales, down_scales, block)))
    return layers


class BucketBench:
    """One bucket's inputs and timer: ``ms(config)`` a layer, averaged over the ``LAYERS`` copies."""

    def __init__(self, layers: list[tuple], num_tokens: int, top_k: int, gen: torch.Generator,
                 dtype: torch.dtype = torch.bfloat16):
        gate_up, down, _ = layers[0]
        num_experts, _, hidden = gate_up.shape
        self.layers, self.num_tokens = layers, num_tokens
        self.x = torch.randn(num_tokens, hidden, device=gen.device, dtype=dtype, generator=gen)
        logits = torch.randn(num_tokens, num_experts, device=gen.device, dtype=dtype, generator=gen)
        self.weights, self.ids = route(logits, top_k, True)
        counts = torch.bincount(self.ids.reshape(-1).long(), minlength=num_experts)
        self.pairs_per_expert = counts.tolist()
        expert_tensors = [gate_up, down] + ([] if layers[0][2] is None else list(layers[0][2][:2]))
        per_expert = sum(t[0].numel() * t.element_size() for t in expert_tensors)
        self.weight_bytes = int((counts > 0).sum()) * per_expert  # one layer's experts that have a pair

    def run(self, config: dict | None, layer: int = 0, gemv: bool = False) -> torch.Tensor:
        gate_up, down, scales = self.layers[layer]
        return fused_experts(self.x, gate_up, down, self.ids, self.weights, config, gemv=gemv, fp8_scales=scales)

    def ms(self, config: dict | None, gemv: bool = False) -> float:
        def layers():
            for layer in range(LAYERS):
                self.run(config, layer, gemv)
        try:
            layers()
        except triton.runtime.errors.OutOfResources:  # tiles that do not fit in shared memory
            return float("inf")
        return triton.testing.do_bench_cudagraph(layers, rep=20) / LAYERS

    def programs(self, config: dict, part: str, cols: int) -> int:
        """Programs of one GEMM that have work (the layout's blocks of BLOCK_M pairs of one expert, times the
        column tiles); the launch's other blocks return at once."""
        blocks = sum(triton.cdiv(n, config["BLOCK_M"]) for n in self.pairs_per_expert)
        return blocks * triton.cdiv(cols, config[part]["BLOCK_N"])

    def error(self, config: dict | None) -> float:
        """Relative error against the torch path: ``run_experts`` on the dequantized weights, in x's dtype."""
        from omni_triton.models.layers.moe import run_experts
        from omni_triton.models.quantization import dequantize_fp8

        gate_up, down, scales = self.layers[0]
        if scales is not None:
            gate_up = dequantize_fp8(gate_up, scales[0], scales[2], self.x.dtype)
            down = dequantize_fp8(down, scales[1], scales[2], self.x.dtype)
        want = run_experts(self.x, gate_up, down, self.ids, self.weights).double()
        got = self.run(config).double()
        return float((got - want).norm() / want.norm().clamp_min(1e-30))


def bf16_search(bench: BucketBench, top_k: int, num_experts: int, candidates: list[dict]) -> tuple:
    """(ms, config): per BLOCK_M, the gate/up GEMM's best candidate, then the down GEMM's."""
    best = None
    for block_m in block_m_candidates(bench.num_tokens, top_k, num_experts):
        config = dict(default_config(bench.num_tokens), BLOCK_M=block_m)
        for part in ("gate_up", "down"):
            timed = [(bench.ms(dict(config, **{part: gemm})), gemm) for gemm in candidates]
            config[part] = min(timed, key=lambda t: t[0])[1]
        took = bench.ms(config)
        if best is None or took < best[0]:
            best = (took, config)
    return best


def fp8_search(bench: BucketBench, top_k: int, num_experts: int, deadline: float, say, precompile=None) -> tuple:
    """(ms, config) of FP8 experts: per BLOCK_M and per GEMM (gate/up first, down at the size rule's tile
    meanwhile), every ``FP8_TILES`` shape at 3 stages, the best shape at ``FP8_STAGES``, then the best with the
    scales on the weights, should that be faster. Stops trying new candidates at ``deadline`` (time.monotonic()).
    ``precompile(num_tokens, configs)`` (a ``CompilePool``) compiles each round's candidates before they are timed."""
    best = None
    for block_m in fp8_block_m_candidates(bench.num_tokens, top_k, num_experts):
        config = dict(default_config(bench.num_tokens), BLOCK_M=block_m)
        for part in ("gate_up", "down"):
            tried: dict[tuple, float] = {}

            def trial(gemm: dict) -> float:
                key = tuple(sorted(gemm.items()))
                if key not in tried:
                    if time.monotonic() > deadline:
                        return float("inf")
                    if fp8_shared_bytes(part, block_m, gemm) > SHARED_MEMORY_BYTES:
                        tried[key] = float("inf")
                    else:
                        tried[key] = bench.ms(dict(config, **{part: gemm}))
                        say(f"  BLOCK_M {block_m} {part} {describe(gemm)}: {tried[key] * 1e3:.1f} us/layer, "
                            f"{bench.weight_bytes / (tried[key] * 1e-3) / 1e9:.0f} GB/s")
                return tried[key]

            def best_of(gemms: list[dict]) -> dict:
                if precompile is not None and time.monotonic() < deadline:
                    precompile(bench.num_tokens, [dict(config, **{part: gemm}) for gemm in gemms
                                                  if fp8_shared_bytes(part, block_m, gemm) <= SHARED_MEMORY_BYTES])
                return min(gemms, key=trial)

            pick = best_of([dict(BLOCK_N=n, BLOCK_K=k, num_warps=w, num_stages=3, SCALE_AFTER_DOT=True)
                            for n, k, w in FP8_TILES])
            pick = best_of([dict(pick, num_stages=s) for s in FP8_STAGES])
            pick = best_of([pick, dict(pick, SCALE_AFTER_DOT=False)])  # or the torch path's rounding
            if trial(pick) < float("inf"):
                config[part] = pick
        took = bench.ms(config)
        say(f"  BLOCK_M {block_m}: {took * 1e3:.1f} us/layer {describe_config(config)}")
        if best is None or took < best[0]:
            best = (took, config)
    return best


class CompilePool:
    """Compiles candidates before they are timed, in worker processes: each runs the fused MoE once on experts of
    the same shapes, only fewer of them (``COMPILE_EXPERTS``), at the bucket's token count, so that the kernels get
    the same specializations and the timing process finds them in Triton's on-disk cache (a serial compile took
    ~1 s a candidate; a bucket tries ~30). Nothing is timed while the workers run."""

    def __init__(self, workers: int, hidden: int, inter: int, top_k: int, fp8: bool, device: str, dtype: torch.dtype):
        import concurrent.futures
        import multiprocessing

        # the worker functions by their importable module (this one may run as __main__)
        from omni_triton.bench import tune_fused_moe as importable

        self.futures, self.run = concurrent.futures, importable._compile_worker_run
        self.pool = concurrent.futures.ProcessPoolExecutor(
            workers, mp_context=multiprocessing.get_context("spawn"), initializer=importable._compile_worker_init,
            initargs=(hidden, inter, top_k, fp8, FP8_BLOCK, device, dtype))
        self.sent: set[str] = set()

    def __call__(self, num_tokens: int, configs: list[dict]) -> None:
        """Compiles ``configs`` at ``num_tokens``; a worker's failure is printed and the timing compiles what it
        missed (a broken pool is not used again)."""
        if self.pool is None:
            return
        todo = {json.dumps([num_tokens, config], sort_keys=True): config for config in configs}
        try:
            futures = [self.pool.submit(self.run, num_tokens, config)
                       for key, config in todo.items() if key not in self.sent]
            self.sent.update(todo)
            done, late = self.futures.wait(futures, timeout=300)
            errors = [future.exception() for future in done if future.exception() is not None]
        except Exception as error:  # BrokenProcessPool and the like: compile as timed from now on
            print(f"  compile workers failed ({error!r}): compiling as timed", flush=True)
            self.close()
            return
        if errors:
            print(f"  {len(errors)} precompiles failed, the first: {errors[0]!r}", flush=True)
        if late:
            print(f"  {len(late)} precompiles still running after 300 s: timing compiles them", flush=True)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)
            self.pool = None


COMPILE_EXPERTS = 8
_compile_worker: dict = {}


def _compile_worker_init(hidden: int, inter: int, top_k: int, fp8: bool, block: tuple[int, int], device: str,
                         dtype: torch.dtype) -> None:
    gen = torch.Generator(device=device).manual_seed(0)
    _compile_worker.update(gen=gen, top_k=top_k, dtype=dtype, layers=expert_weights(
        COMPILE_EXPERTS, hidden, inter, fp8, gen, dtype, block, copies=1))


def _compile_worker_run(num_tokens: int, config: dict) -> None:
    bench = _compile_worker.get(num_tokens)
    if bench is None:
        bench = _compile_worker[num_tokens] = BucketBench(_compile_worker["layers"], num_tokens,
                                                          _compile_worker["top_k"], _compile_worker["gen"],
                                                          _compile_worker["dtype"])
    try:
        bench.run(config)
        if bench.x.is_cuda:
            torch.cuda.synchronize()
    except triton.runtime.errors.OutOfResources:
        pass


def scales_on_weights(config: dict) -> dict:
    """``config`` with FP8's scales applied to the weights before the dot (the torch path's rounding)."""
    return dict(config, gate_up=dict(config["gate_up"], SCALE_AFTER_DOT=False),
                down=dict(config["down"], SCALE_AFTER_DOT=False))


def describe(gemm: dict) -> str:
    order = "" if gemm.get("SCALE_AFTER_DOT", True) else " scales-on-weights"
    return f"N{gemm['BLOCK_N']} K{gemm['BLOCK_K']} w{gemm['num_warps']} s{gemm['num_stages']}{order}"


def describe_config(config: dict) -> str:
    return f"M{config['BLOCK_M']} gate_up[{describe(config['gate_up'])}] down[{describe(config['down'])}]"


def check_e4m3_conversion() -> str:
    """The GEMMs' e4m3 -> bf16 (``fused_moe.e4m3_as_bf16``) against torch's on every finite code, as a line."""
    codes = torch.arange(256, dtype=torch.int32, device="cuda").to(torch.uint8)
    finite = (codes & 0x7F) != 0x7F
    got = e4m3_as_bf16(codes.view(torch.float8_e4m3fn))[finite].view(torch.int16)
    want = codes.view(torch.float8_e4m3fn).to(torch.bfloat16)[finite].view(torch.int16)
    wrong = codes[finite][got != want].tolist()
    return (f"e4m3 -> bf16 in the grouped GEMMs: exact on all {int(finite.sum())} finite codes" if not wrong else
            f"e4m3 -> bf16 in the grouped GEMMs: WRONG on {len(wrong)} codes ({wrong[:8]}...): fix _e4m3_as_bf16")


def tune_shape(num_experts: int, hidden: int, inter: int, top_k: int, fp8: bool, table: dict[str, dict], save,
               buckets=BUCKETS, candidates=GEMM_CANDIDATES, budget_s: float | None = None,
               peak_gbs: float = 4800.0, device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
               compile_workers: int = 0) -> list[str]:
    """Fills ``table`` bucket by bucket, calling ``save()`` after each (a cut-short run keeps what it found);
    returns the summary table's rows. (``device``, ``dtype``: the activations'; tests run it on the CPU.)
    ``compile_workers``: FP8, processes that compile candidates ahead of their timing (``CompilePool``)."""
    say = functools.partial(print, flush=True)
    gen = torch.Generator(device=device).manual_seed(0)
    layers = expert_weights(num_experts, hidden, inter, fp8, gen, dtype, FP8_BLOCK)
    rows = []
    start = time.monotonic()
    pool = CompilePool(compile_workers, hidden, inter, top_k, fp8, device, dtype) if fp8 and compile_workers else None
    try:
        for index, num_tokens in enumerate(buckets):
            rows.append(tune_bucket(layers, num_tokens, top_k, fp8, candidates, gen, dtype, pool, peak_gbs, say,
                                    deadline_share(budget_s, start, len(buckets) - index), table, save))
    finally:
        if pool is not None:
            pool.close()
    return rows


def deadline_share(budget_s: float | None, start: float, buckets_left: int) -> float:
    """time.monotonic() at which this bucket's search stops: an equal share of what is left of the budget."""
    if budget_s is None:
        return float("inf")
    return time.monotonic() + max(0.0, budget_s - (time.monotonic() - start)) / buckets_left


def tune_bucket(layers: list[tuple], num_tokens: int, top_k: int, fp8: bool, candidates: list[dict],
                gen: torch.Generator, dtype: torch.dtype, pool, peak_gbs: float, say, deadline: float,
                table: dict[str, dict], save) -> str:
    """Searches one bucket, prints its line, writes its entry if it matches the torch path; its table row."""
    num_experts, two_inter, hidden = layers[0][0].shape
    inter = two_inter // 2
    weights = "fp8" if fp8 else "bf16"
    bench = BucketBench(layers, num_tokens, top_k, gen, dtype)
    say(f"E{num_experts} H{hidden} I{inter} k{top_k} {weights} tokens {num_tokens}: "
        f"{bench.weight_bytes / 1e6:.0f} MB of expert weights a layer")
    rule = default_config(num_tokens)
    if fp8:
        if pool is not None:
            pool(num_tokens, [rule, scales_on_weights(rule)])
        took, config = fp8_search(bench, top_k, num_experts, deadline, say, pool)
    else:
        took, config = bf16_search(bench, top_k, num_experts, candidates)
    rule_ms = bench.ms(rule)
    # FP8 before SCALE_AFTER_DOT: the size rule's tiles with the scales on the weights (what an untuned GPU ran)
    before = f"{bench.ms(scales_on_weights(rule)) * 1e3:.1f}" if fp8 else "-"
    # the decode sizes' per-pair GEMVs (what --linear-launch gemv runs there) beside the grouped GEMMs
    by_pair = f"{bench.ms(None, gemv=True) * 1e3:.1f}" if num_tokens <= GEMV_MAX_TOKENS else "-"
    error = bench.error(config)
    gbs = bench.weight_bytes / (took * 1e-3) / 1e9
    programs = f"{bench.programs(config, 'gate_up', inter)} / {bench.programs(config, 'down', hidden)}"
    checked = error < 1e-2
    say(f"E{num_experts} H{hidden} I{inter} k{top_k} {weights} tokens {num_tokens}: {took * 1e3:.1f} us/layer, "
        f"{gbs:.0f} GB/s ({gbs / peak_gbs:.0%} of {peak_gbs:.0f}) (size rule {rule_ms * 1e3:.1f}, with the scales "
        f"on the weights {before}, per-pair GEMVs {by_pair}) error {error:.1e} {describe_config(config)}")
    if checked:
        table[str(num_tokens)] = config
        save()
    else:
        say(f"  not written: error {error:.1e} against the torch path (want < 1e-2)")
    return (f"| {weights} | {num_tokens} | {describe_config(config)} | {took * 1e3:.1f} | {gbs:.0f} "
            f"({gbs / peak_gbs:.0%}) | {rule_ms * 1e3:.1f} | {before} | {by_pair} | {programs} | {error:.1e}"
            f"{'' if checked else ' FAILED'} |")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=FULL_SIZE_CONFIG)
    parser.add_argument("--out", default="fused_moe_configs.json")
    parser.add_argument("--stages", default="thinker,talker", help="whose MoE shapes to tune (comma list)")
    parser.add_argument("--buckets", "--tokens", default=",".join(map(str, BUCKETS)),
                        help="token-count buckets to tune (comma list; the table keeps these only)")
    parser.add_argument("--quantization", default="none",
                        help="expert weights to tune for (comma list of none, fp8: bf16 and block-FP8 w8a16)")
    parser.add_argument("--wide", action="store_true", help="bf16: also try WIDE_CANDIDATES (longer run)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="FP8: seconds for each weight format's search of one shape (each bucket a share)")
    parser.add_argument("--compile-workers", type=int, default=max(0, min(12, (os.cpu_count() or 1) - 2)),
                        help="FP8: processes compiling candidates ahead of their timing (0: compile as timed)")
    parser.add_argument("--peak-gbs", type=float, default=4800.0,
                        help="memory bandwidth the GB/s column is held against (H200: 4.8 TB/s nominal)")
    args = parser.parse_args(argv)
    stages = args.stages.split(",")
    if not stages or set(stages) - {"thinker", "talker"}:
        parser.error(f"--stages: thinker and/or talker, got {args.stages!r}")
    quantizations = args.quantization.split(",")
    if set(quantizations) - {"none", "fp8"}:
        parser.error(f"--quantization: none and/or fp8, got {args.quantization!r}")
    buckets = [int(b) for b in args.buckets.split(",")]
    candidates = GEMM_CANDIDATES + (WIDE_CANDIDATES if args.wide else [])
    config = OmniConfig.from_pretrained(resolve_config_dir(args.config))
    out = Path(args.out)
    table = json.loads(out.read_text()) if out.is_file() else {}
    tuned = table.setdefault(torch.cuda.get_device_name(), {})

    def save():
        out.write_text(json.dumps(table, indent=1) + "\n")

    rows = []
    conversion = check_e4m3_conversion() if "fp8" in quantizations else ""
    if conversion:
        print(conversion, flush=True)
    for stage in stages:
        text = getattr(config, stage).text
        for quantization in quantizations:
            fp8 = quantization == "fp8"
            shape = tuned[shape_key(text.num_experts, text.hidden_size, text.moe_intermediate_size, fp8)] = {}
            rows += tune_shape(text.num_experts, text.hidden_size, text.moe_intermediate_size, text.num_experts_per_tok,
                               fp8, shape, save, buckets, candidates, args.budget_s, args.peak_gbs,
                               compile_workers=args.compile_workers)
    print(f"\n{torch.cuda.get_device_name()}, {torch.cuda.get_device_properties(0).multi_processor_count} SMs:\n")
    print("| weights | tokens | config | us/layer | expert weights GB/s | size rule us | size rule, scales on the "
          "weights us | per-pair GEMVs us | programs gate_up / down | error |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    print("\n".join(rows))
    print(f"\n{conversion}\nwrote {out}")


if __name__ == "__main__":
    main()
