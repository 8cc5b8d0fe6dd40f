"""sample_rows alone (served controls: temperature 0.9, top-k 50, top-p 0.8), 2048 and 3072 ids, CUDA graph of 50 calls."""
import sys, torch
sys.path.insert(0, "benchmarks")
from engine_microbench import graph_seconds_per_call
from omni_triton.kernels.sampling import sample_rows
dev = torch.device("cuda")


def served_inputs(vocab, rows):
    """50 steps of bf16 logits [50, rows, vocab] and the served controls (temperature, top-k, top-p, seeds)."""
    gen = torch.Generator(device=dev).manual_seed(rows)
    logits = (torch.randn(50, rows, vocab, device=dev, generator=gen) * 3).to(torch.bfloat16)
    t = torch.full((rows,), 0.9, device=dev); k = torch.full((rows,), 50, device=dev, dtype=torch.int64)
    p = torch.full((rows,), 0.8, device=dev); seeds = torch.arange(rows, device=dev, dtype=torch.int64)
    return logits, t, k, p, seeds


if __name__ == "__main__":
    for vocab in (2048, 3072):
        for rows in (1, 64):
            logits, t, k, p, seeds = served_inputs(vocab, rows)
            s = graph_seconds_per_call(lambda: [sample_rows(logits[i], t, k, p, seeds, i) for i in range(50)], 50)
            codes = torch.stack([sample_rows(logits[i], t, k, p, seeds, i) for i in range(50)])
            print(f"vocab {vocab} rows {rows:3d}: {s*1e6:.2f} us a call  checksum {int(codes.sum())}", flush=True)
