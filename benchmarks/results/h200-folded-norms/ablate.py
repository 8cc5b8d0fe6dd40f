"""Upper bounds: the 64-row predictor frame with launches removed (wrong math, same shapes)."""
import statistics, sys, torch, torch.nn.functional as F
sys.path.insert(0, "benchmarks")
from engine_microbench import config_dir
from omni_triton.graph_buckets import capturing
from omni_triton.kernels.dependent_launch import set_dependent_launch
from omni_triton.kernels.frame_attention import frame_attention
from omni_triton.kernels.small_linear import small_linear
from omni_triton.kernels.activation import silu_and_mul
from omni_triton.kernels.norm import rms_norm
from omni_triton.kernels.sampling import sample_rows
from omni_triton.models.config import FULL_SIZE_CONFIG
from omni_triton.models.layers.fast_kernels import set_fast_kernels, set_fused_steps, set_linear_launch
from omni_triton.models.weights import load_talker

def frame(self, hidden, code0, sample_fn, no_norm=False, no_silu=False, no_head_norm=False, no_gather=False,
          no_attn=False):
    cfg, model = self.config, self.model
    launch = dict(split_k=None, gemv=True, cublas=True)
    rows, H = hidden.shape
    P = self.num_code_groups
    cos, sin = self._rope_table(P, hidden)
    keys = torch.empty((cfg.num_layers, rows, cfg.num_kv_heads, P, cfg.head_dim), dtype=hidden.dtype, device=hidden.device)
    values = torch.empty_like(keys)
    x = torch.stack((hidden, code0), dim=1).reshape(rows * 2, H)
    start, new = 0, 2
    codes = []
    for group in range(1, P):
        for i, layer in enumerate(model.layers):
            attn, mlp = layer.self_attn, layer.mlp
            attn.pack_projections_(); mlp.pack_projections_()
            if no_norm:
                qkv = F.linear(x, attn.packed_qkv[0])
            else:
                qkv = small_linear(x, attn.packed_qkv[0], norm_weight=layer.input_layernorm.weight,
                                   eps=layer.input_layernorm.eps, **launch)
            if no_attn:
                attended = qkv[:, :2048]
            else:
                attended = frame_attention(qkv, attn.q_norm.weight, attn.k_norm.weight, cos, sin, keys[i], values[i],
                                           start, new, cfg.num_heads, attn.q_norm.eps, attn.head_dim ** -0.5)
            x = small_linear(attended, attn.o_proj.weight, residual=x, **launch)
            if no_norm:
                gu = F.linear(x, mlp.packed_gate_up[0])
            else:
                gu = rms_norm(x, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps)
                gu = F.linear(gu, mlp.packed_gate_up[0])
            h = gu[:, :gu.shape[1] // 2] if no_silu else silu_and_mul(gu)
            x = small_linear(h, mlp.down_proj.weight, residual=x, **launch)
        last = x.view(rows, new, H)[:, -1]
        if no_head_norm:
            logits = F.linear(last, self.lm_head[group - 1].weight)
        else:
            logits = small_linear(last, self.lm_head[group - 1].weight, norm_weight=model.norm.weight,
                                  eps=model.norm.eps, **launch)
        code = sample_fn(logits, group)
        codes.append(code)
        x = self._static_x if no_gather else model.codec_embedding[group - 1](code)
        start, new = start + new, 1
    return torch.stack(codes, 1)

def time_frame(fn):
    for _ in range(2): fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with capturing(g):
        fn()
    for _ in range(5): g.replay()
    ts = []
    for _ in range(7):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(20): g.replay()
        e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e) / 20)
    return statistics.median(ts)

dev = torch.device("cuda")
talker = load_talker(config_dir(FULL_SIZE_CONFIG, 0), dev, torch.bfloat16, load_format="dummy")
set_fast_kernels(talker, True); set_fused_steps(talker, True); set_linear_launch(talker, "gemv"); set_dependent_launch(True)
cp = talker.code_predictor
VARIANTS = {"base": {}, "no_norm": dict(no_norm=True), "no_norm_silu": dict(no_norm=True, no_silu=True),
            "no_norm_silu_head": dict(no_norm=True, no_silu=True, no_head_norm=True),
            "no_all4": dict(no_norm=True, no_silu=True, no_head_norm=True, no_gather=True),
            "no_attn": dict(no_attn=True), "base_greedy": "greedy"}
for rows in [int(r) for r in (sys.argv[1] if len(sys.argv) > 1 else "64,32").split(",")]:
    gen = torch.Generator(device=dev).manual_seed(rows)
    hidden, code0 = torch.randn(2, rows, 1024, device=dev, dtype=torch.bfloat16, generator=gen)
    cp._static_x = torch.randn(rows, 1024, device=dev, dtype=torch.bfloat16, generator=gen)
    temp = torch.full((rows,), 0.9, device=dev); topk = torch.full((rows,), 50, device=dev, dtype=torch.int64)
    topp = torch.full((rows,), 1.0, device=dev); seeds = torch.arange(rows, device=dev, dtype=torch.int64)
    sampled = lambda logits, group: sample_rows(logits, temp, topk, topp, seeds, group)
    greedy = lambda logits, group: logits.argmax(-1)
    res = {}
    for rnd in range(2):
        for name, kw in VARIANTS.items():
            fn = (lambda kw=kw: frame(cp, hidden, code0, greedy)) if kw == "greedy" else \
                 (lambda kw=kw: frame(cp, hidden, code0, sampled, **kw))
            res.setdefault(name, []).append(time_frame(fn))
    print(f"rows {rows}: " + "  ".join(f"{n} {min(v):.3f}" for n, v in res.items()), flush=True)
