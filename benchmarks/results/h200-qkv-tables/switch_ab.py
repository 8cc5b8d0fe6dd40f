"""The 15 predictor steps under a CUDA graph, a CodePredictor switch off vs on (same tree), interleaved.

    PYTHONPATH=$PWD:$PWD/benchmarks python switch_ab.py SWITCH ROWS [OUT.json]   (SWITCH: qkv_tables, tma_linears)
"""
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
switch = sys.argv[1]
for rows in [int(r) for r in sys.argv[2].split(",")]:
    gen = torch.Generator(device=dev).manual_seed(rows)
    hidden, code0 = torch.randn(2, rows, 1024, device=dev, dtype=torch.bfloat16, generator=gen)
    res = {True: [], False: []}
    codes = {}
    for _ in range(2):
        for on in (False, True):
            setattr(CodePredictor, switch, on)
            ms, c = frame_ms(cp, hidden, code0)
            res[on].append(ms); codes[on] = c
    same = float((codes[True] == codes[False]).float().mean())
    row = dict(rows=rows, off_ms=res[False], on_ms=res[True], codes_equal=same)
    out.append(row)
    print(f"rows {rows:4d}: {switch} off {min(res[False]):.3f} ms  on {min(res[True]):.3f} ms  "
          f"({min(res[True]) / min(res[False]):.3f}x)  greedy codes equal {same:.3f}  all {res}", flush=True)
if len(sys.argv) > 3:
    os.makedirs(os.path.dirname(sys.argv[3]), exist_ok=True)
    json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, switch=switch, rows=out), open(sys.argv[3], "w"), indent=2)
