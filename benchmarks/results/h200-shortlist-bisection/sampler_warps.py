"""sample_rows's kernel at 2, 4, 8, 16 warps (served controls), 2048 / 3072 ids, 1 and 64 rows; same draws?"""
import sys, torch, triton
sys.path.insert(0, "benchmarks")
from engine_microbench import graph_seconds_per_call
from omni_triton.kernels import sampling
from sampler_probe import dev, served_inputs  # the same inputs as sampler_probe.py

def run(logits, t, k, p, seeds, group, warps):
    rows, vocab = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=dev)
    block_v = max(16, triton.next_power_of_2(vocab))
    scratch = torch.empty(rows, sampling.SHORTLIST, dtype=torch.int64, device=dev)
    sampling._sample_rows_kernel[(rows,)](logits, logits.stride(0), vocab, t, k, p, seeds, group, scratch, out,
                                          BLOCK_V=block_v, ID_BITS=block_v.bit_length() - 1, FAST_K=sampling.FAST_TOP_K,
                                          SHORT=sampling.SHORTLIST, num_warps=warps, PDL=True, launch_pdl=True)
    return out

for vocab in (2048, 3072):
    for rows in (1, 64):
        logits, t, k, p, seeds = served_inputs(vocab, rows)
        ref = torch.stack([sampling.sample_rows(logits[i], t, k, p, seeds, i) for i in range(50)])
        cells = []
        for warps in (2, 4, 8, 16):
            got = torch.stack([run(logits[i], t, k, p, seeds, i, warps) for i in range(50)])
            s = graph_seconds_per_call(lambda: [run(logits[i], t, k, p, seeds, i, warps) for i in range(50)], 50)
            cells.append(f"{warps}w {s*1e6:.2f} us{'' if torch.equal(got, ref) else ' (DIFFERENT)'}")
        print(f"vocab {vocab} rows {rows:3d}: " + "  ".join(cells), flush=True)
