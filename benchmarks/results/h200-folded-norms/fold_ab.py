"""The 15 predictor steps under a CUDA graph, folded pre-norms on vs off (same tree), interleaved."""
import json, os, sys, torch
sys.path.insert(0, "benchmarks")
from engine_microbench import config_dir
from predictor_bench import frame_ms
from omni_triton.kernels.dependent_launch import set_dependent_launch
from omni_triton.models.code_predictor import CodePredictor
from omni_triton.models.config import FULL_SIZE_CONFIG
from omni_triton.models.layers.fast_kernels import set_fast_kernels, set_fused_steps, set_linear_launch
from omni_triton.models.weights import load_talker

dev = torch.device("cuda")
talker = load_talker(config_dir(FULL_SIZE_CONFIG, 0), dev, torch.bfloat16, load_format="dummy")
set_fast_kernels(talker, True); set_fused_steps(talker, True); set_linear_launch(talker, "gemv"); set_dependent_launch(True)
cp = talker.code_predictor
out = []
for rows in [int(r) for r in sys.argv[1].split(",")]:
    gen = torch.Generator(device=dev).manual_seed(rows)
    hidden, code0 = torch.randn(2, rows, 1024, device=dev, dtype=torch.bfloat16, generator=gen)
    res = {True: [], False: []}
    codes = {}
    for _ in range(2):
        for fold in (False, True):
            CodePredictor.fold_norms = fold
            ms, c = frame_ms(cp, hidden, code0)
            res[fold].append(ms); codes[fold] = c
    same = float((codes[True] == codes[False]).float().mean())
    row = dict(rows=rows, norm_launches_ms=res[False], folded_ms=res[True], codes_equal=same)
    out.append(row)
    print(f"rows {rows:4d}: norm launches {min(res[False]):.3f} ms  folded {min(res[True]):.3f} ms  "
          f"({min(res[True]) / min(res[False]):.3f}x)  greedy codes equal {same:.3f}  all {res}", flush=True)
if len(sys.argv) > 2:
    os.makedirs(os.path.dirname(sys.argv[2]), exist_ok=True)
    json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=out), open(sys.argv[2], "w"), indent=2)
