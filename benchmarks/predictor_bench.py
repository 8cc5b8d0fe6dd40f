"""The code predictor's 15 steps of one frame (``CodePredictor.predict_with_kernels``, greedy) under a CUDA graph, at
several row counts, in three launches of its linears (the question: which rows should take cuBLAS, and which
linears):

- ``fused``: every linear one ``small_linear`` kernel launch (the served launch before ``cublas=True`` existed);
- ``served``: the served launch, ``small_linear(gemv=True, cublas=True)``: the wide outputs without a residual
  (qkv, gate/up, lm_head) from ``CUBLAS_MIN_ROWS`` rows through the norm kernel + cuBLAS + the activation kernel;
- ``all-cublas``: o and down too (cuBLAS, then the residual add).

Or, with ``--switch NAME``, the served launch with one ``CodePredictor`` switch (``fold_norms``, ``qkv_tables``,
``tma_linears``: docs/fused_steps.md) off and on, interleaved twice in the same process.

    python benchmarks/predictor_bench.py --out-dir benchmarks/results/NAME
    python benchmarks/predictor_bench.py --switch qkv_tables --rows 1,8,32,64,128 --out-dir OUT

Full size (Qwen3-Omni-30B-A3B's predictor: 5 layers, hidden 1024, 2048 codes), seeded random bf16 weights. Per row
count and launch: ms per frame's 15 steps (the median of 5 x 20 replays) and the share of codes equal to the fused
launch's (random weights: greedy picks may flip on near-ties where only the sum order differs). CUDA only. Writes
predictor_bench.{json,md}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

from engine_microbench import config_dir
from omni_triton.graph_buckets import capturing
from omni_triton.kernels import small_linear as small_linear_module
from omni_triton.kernels.dependent_launch import set_dependent_launch
from omni_triton.models.code_predictor import CodePredictor, greedy
from omni_triton.models.config import FULL_SIZE_CONFIG
from omni_triton.models.layers.fast_kernels import set_fast_kernels, set_fused_steps, set_linear_launch
from omni_triton.models.weights import load_talker

LAUNCHES = ("fused", "served", "all-cublas")
SWITCHES = ("fold_norms", "qkv_tables", "tma_linears")  # CodePredictor class attributes, default on


@contextlib.contextmanager
def launch(name: str):
    """``small_linear`` as launch ``name`` wants it, while the frame is captured."""
    real_takes, real_linear = small_linear_module.takes_cublas, small_linear_module.small_linear

    def all_cublas(x, weight, *, residual=None, **kwargs):
        if residual is None or x.shape[0] < small_linear_module.CUBLAS_MIN_ROWS:
            return real_linear(x, weight, residual=residual, **kwargs)
        return residual + F.linear(x, weight)

    if name == "fused":
        small_linear_module.takes_cublas = lambda rows, cols, residual: False
    elif name == "all-cublas":
        small_linear_module.small_linear = all_cublas
    try:
        yield
    finally:
        small_linear_module.takes_cublas, small_linear_module.small_linear = real_takes, real_linear


def frame_ms(predictor, hidden: torch.Tensor, code0_embeds: torch.Tensor) -> tuple[float, torch.Tensor]:
    """(ms per replay of the captured frame, its codes)."""
    for _ in range(2):  # compiled, packed and the rotary table made before capture
        predictor.predict_with_kernels(hidden, code0_embeds, greedy)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with capturing(graph):
        codes, _ = predictor.predict_with_kernels(hidden, code0_embeds, greedy)
    for _ in range(5):
        graph.replay()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 20)
    return statistics.median(times), codes.clone()


def switch_row(predictor, switch: str, rows: int, hidden: torch.Tensor, code0_embeds: torch.Tensor) -> dict:
    """The frame with ``CodePredictor.<switch>`` off and on, twice each in turn (the GPU's speed drifts); the
    switch is left at its default (on) after."""
    times: dict[bool, list[float]] = {False: [], True: []}
    codes = {}
    try:
        for _ in range(2):
            for on in (False, True):
                setattr(CodePredictor, switch, on)
                ms, codes[on] = frame_ms(predictor, hidden, code0_embeds)
                times[on].append(ms)
    finally:
        setattr(CodePredictor, switch, True)
    row = dict(rows=rows, off_ms=times[False], on_ms=times[True],
               codes_equal=float((codes[True] == codes[False]).float().mean()))
    print(f"rows {rows:4d}: {switch} off {min(times[False]):.3f} ms, on {min(times[True]):.3f} ms, "
          f"greedy codes equal {row['codes_equal']:.3f}", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8,16,32,64,128")
    parser.add_argument("--out-dir", default=".")
    parser.add_argument("--switch", choices=SWITCHES,
                        help="instead of the three launches: this switch off / on in the served launch, interleaved")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("predictor_bench.py needs a CUDA GPU")
    device = torch.device("cuda")
    talker = load_talker(config_dir(FULL_SIZE_CONFIG, 0), device, torch.bfloat16, load_format="dummy")
    set_fast_kernels(talker, True)
    set_fused_steps(talker, True)
    set_linear_launch(talker, "gemv")
    set_dependent_launch(True)
    results = []
    for rows in [int(r) for r in args.rows.split(",")]:
        gen = torch.Generator(device=device).manual_seed(rows)
        hidden, code0_embeds = torch.randn(2, rows, talker.hidden_size, device=device, dtype=torch.bfloat16,
                                           generator=gen)
        if args.switch:
            results.append(switch_row(talker.code_predictor, args.switch, rows, hidden, code0_embeds))
            continue
        row, fused_codes = {"rows": rows}, None
        for name in LAUNCHES:
            with launch(name):
                ms, codes = frame_ms(talker.code_predictor, hidden, code0_embeds)
            fused_codes = codes if fused_codes is None else fused_codes
            row[name] = dict(ms=ms, codes_equal_to_fused=float((codes == fused_codes).float().mean()))
        results.append(row)
        print(f"rows {rows:4d}: " + "  ".join(f"{name} {row[name]['ms']:.3f} ms" for name in LAUNCHES), flush=True)
    if args.switch:
        lines = [f"| rows | {args.switch} off ms | on ms | on / off | greedy codes equal |",
                 "|---:|---:|---:|---:|---:|"]
        lines += [f"| {r['rows']} | {min(r['off_ms']):.3f} | {min(r['on_ms']):.3f} | "
                  f"{min(r['on_ms']) / min(r['off_ms']):.3f} | {r['codes_equal']:.3f} |" for r in results]
    else:
        lines = ["| rows | " + " | ".join(f"{name} ms (codes = fused)" for name in LAUNCHES) + " |",
                 "|---:|" + "---:|" * len(LAUNCHES)]
        lines += [f"| {row['rows']} | " + " | ".join(f"{row[n]['ms']:.3f} ({row[n]['codes_equal_to_fused']:.2f})"
                                                     for n in LAUNCHES) + " |" for row in results]
    header = (f"Code predictor, 15 steps of one frame under a CUDA graph; {torch.cuda.get_device_name()}, "
              f"torch {torch.__version__}\n\n")
    print(header + "\n".join(lines))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "predictor_bench.json").write_text(json.dumps(dict(device_name=torch.cuda.get_device_name(),
                                                              torch=torch.__version__, rows=results), indent=2) + "\n")
    (out / "predictor_bench.md").write_text(header + "\n".join(lines) + "\n")
    print(f"wrote {out / 'predictor_bench.json'} and {out / 'predictor_bench.md'}")


if __name__ == "__main__":
    main()
