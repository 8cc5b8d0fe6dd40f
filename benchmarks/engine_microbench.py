"""Engine microbenchmark: decode tokens/s vs batch size and prefill tokens/s of the thinker or the talker
(a talker token = one codec frame: talker step + batched code predictor), each printed next to the
weight-bandwidth floor (bytes a step must read / measured copy bandwidth).

    python benchmarks/engine_microbench.py --config tiny [--stage talker]     # CPU, tiny random checkpoint
    python benchmarks/engine_microbench.py --checkpoint DIR --device cuda --dtype bfloat16
    python benchmarks/engine_microbench.py --config full-width --device cuda --dtype bfloat16 [--layers 12]

``full-width`` builds random weights in memory with the Qwen3-Omni-30B-A3B dims (thinker: 48 layers, hidden
2048, 32/4 heads x 128, 128 experts top-8 x 768, vocab 152064; talker: 20 layers, hidden 1024, 16/2 heads,
128 experts top-6 x 384 + shared 768, vocab 3072, code predictor 5 layers x 16 groups); ``--layers`` keeps
fewer thinker/talker layers to fit smaller GPUs (the floor scales with it). Writes a JSON too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from omni_triton.engine import EngineConfig, LLMEngine, SamplingParams, TalkerStage, ThinkerStage
from omni_triton.models.config import TalkerConfig, TextModelConfig, ThinkerConfig
from omni_triton.models.talker import Talker
from omni_triton.models.thinker import Thinker
from omni_triton.models.weights import load_talker, load_thinker

FULL_WIDTH_TEXT = dict(
    vocab_size=152064, hidden_size=2048, intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
    num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6,
    rope_parameters=dict(rope_theta=1000000.0, mrope_section=[24, 20, 20]),
    num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
)
FULL_WIDTH_TALKER = dict(
    vocab_size=3072, hidden_size=1024, intermediate_size=2048, num_hidden_layers=20, num_attention_heads=16,
    num_key_value_heads=2, head_dim=128, rms_norm_eps=1e-6,
    rope_parameters=dict(rope_theta=1000000.0, mrope_section=[24, 20, 20]),
    num_experts=128, num_experts_per_tok=6, moe_intermediate_size=384, shared_expert_intermediate_size=768,
    norm_topk_prob=True,
)
FULL_WIDTH_CODE_PREDICTOR = dict(
    vocab_size=2048, hidden_size=1024, intermediate_size=3072, num_hidden_layers=5, num_attention_heads=16,
    num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_parameters=dict(rope_theta=1000000.0),
)
FULL_WIDTH_CODEC_IDS = dict(codec_pad_id=2148, codec_bos_id=2149, codec_eos_token_id=2150, codec_nothink_id=2155,
                            codec_think_bos_id=2156, codec_think_eos_id=2157)


def build_model(args):
    """The thinker or talker module, from a checkpoint, the tiny preset, or full-width random weights."""
    dtype = getattr(torch, args.dtype)
    load = load_thinker if args.stage == "thinker" else load_talker
    extra = dict(with_audio=False) if args.stage == "thinker" else {}
    if args.checkpoint:
        return load(args.checkpoint, args.device, dtype, **extra)
    if args.config == "tiny":
        from build_engines.tiny_checkpoint import build

        return load(build(Path(tempfile.gettempdir()) / "engine_microbench_tiny", "tiny"), args.device, dtype,
                    **extra)
    if args.stage == "thinker":
        text = dict(FULL_WIDTH_TEXT, num_hidden_layers=args.layers or FULL_WIDTH_TEXT["num_hidden_layers"])
        config = ThinkerConfig(text=TextModelConfig.from_dict(text, "full-width", mrope=True), audio=None,
                               audio_token_id=-1, image_token_id=-1, video_token_id=-1, audio_start_token_id=None,
                               vision_start_token_id=None, position_id_per_seconds=25)
        build_module = lambda: Thinker(config)  # noqa: E731
    else:
        text = dict(FULL_WIDTH_TALKER, num_hidden_layers=args.layers or FULL_WIDTH_TALKER["num_hidden_layers"])
        config = TalkerConfig(
            text=TextModelConfig.from_dict(text, "full-width talker", mrope=True),
            code_predictor=TextModelConfig.from_dict(FULL_WIDTH_CODE_PREDICTOR, "full-width predictor", mrope=False),
            num_code_groups=16, thinker_hidden_size=2048, accept_hidden_layer=24, speaker_id={},
            **FULL_WIDTH_CODEC_IDS)
        build_module = lambda: Talker(config)  # noqa: E731
    with torch.device("meta"):
        model = build_module()
    model = model.to(dtype).to_empty(device=args.device).eval()
    generator = torch.Generator(device=args.device).manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=generator)
    return model


def copy_bandwidth(device: str, num_bytes: int) -> float:
    """Bytes/s of a big device-to-device copy (read + write counted)."""
    src = torch.empty(num_bytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * num_bytes / best


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _decoder_bytes(params: dict[str, torch.Tensor], prefix: str, text: TextModelConfig, num_tokens: int,
                   element: int) -> float:
    """Weights under ``prefix`` one forward of `num_tokens` tokens reads: dense ones whole, routed experts by the
    expected fraction `num_tokens` uniformly routed tokens hit, embedding tables only their rows."""
    total = 0.0
    touched = 1.0
    if text.num_experts:
        touched = 1 - (1 - text.num_experts_per_tok / text.num_experts) ** num_tokens
    for name, p in params.items():
        if not name.startswith(prefix):
            continue
        if "embed" in name or "codec_embedding" in name:
            continue
        total += p.numel() * (touched if ".experts." in name else 1.0)
    return (total + num_tokens * text.hidden_size) * element


def step_bytes(model, stage: str, num_tokens: int, context_tokens: int) -> float:
    """Bytes one engine step of `num_tokens` tokens reads, KV of `context_tokens` included. Talker steps add
    the code predictor: one forward per residual codebook over all rows."""
    params = dict(model.named_parameters())
    element = next(model.parameters()).element_size()
    text = model.config.text
    kv = 2 * text.num_layers * text.num_kv_heads * text.head_dim * context_tokens * element
    if stage == "thinker":
        return _decoder_bytes(params, "", text, num_tokens, element) + kv
    talker_bytes = _decoder_bytes({n: p for n, p in params.items() if not n.startswith("code_predictor.")
                                   and "projection" not in n}, "", text, num_tokens, element)
    predictor = model.code_predictor
    layer_bytes = sum(p.numel() for p in predictor.model.parameters() if p.dim() > 1) * element
    layer_bytes -= sum(e.weight.numel() for e in predictor.model.codec_embedding) * element
    head_bytes = sum(h.weight.numel() for h in predictor.lm_head) * element
    return talker_bytes + kv + (model.num_code_groups - 1) * layer_bytes + head_bytes


def run_engine(model, args, batch: int):
    """Returns (prefill seconds, median seconds of a decode step at full batch)."""
    dtype = next(model.parameters()).dtype
    kv_tokens = batch * (args.prompt_len + args.new_tokens) + 64
    hidden = model.hidden_size
    if args.stage == "thinker":
        stage = ThinkerStage(model)
    else:
        stage = TalkerStage(model, tts_eos_embed=torch.zeros(hidden, dtype=dtype, device=args.device),
                            tts_pad_embed=torch.zeros(hidden, dtype=dtype, device=args.device))
    engine = LLMEngine(stage, EngineConfig(
        block_size=16, num_blocks=kv_tokens // 16 + batch, max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=batch, device=args.device, kv_dtype=dtype))
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True)
    for i in range(batch):
        if args.stage == "thinker":
            prompt = torch.randint(0, model.vocab_size, (args.prompt_len,), generator=generator).tolist()
            engine.add_request(str(i), params, prompt_token_ids=prompt)
        else:
            prompt = torch.randn(args.prompt_len, hidden, generator=generator).to(args.device, dtype)
            engine.add_request(str(i), params, prompt_embeds=prompt, thinker_finished=True)
    sync(args.device)
    start = time.perf_counter()
    while any(seq.num_generated == 0 for seq in engine.requests.values()):
        engine.step()
    sync(args.device)
    prefill_s = time.perf_counter() - start
    step_s = []
    while engine.has_work():  # the sampled-id read syncs every step, so per-step wall time is honest
        start = time.perf_counter()
        engine.step()
        step_s.append(time.perf_counter() - start)
    return prefill_s, statistics.median(step_s)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--checkpoint", help="checkpoint dir (only the --stage weights are loaded)")
    source.add_argument("--config", choices=["tiny", "full-width"], default="tiny")
    parser.add_argument("--stage", choices=["thinker", "talker"], default="thinker")
    parser.add_argument("--layers", type=int, default=0, help="full-width: keep this many layers (0 = all)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--batch-sizes", default="1,4,16,64")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=17, help="per request (decode: median step of n - 1)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2, help="CPU threads for torch")
    parser.add_argument("--json", default="engine_microbench.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    model = build_model(args)
    bandwidth = copy_bandwidth(args.device, 1 << 30 if args.device.startswith("cuda") else 1 << 27)
    run_engine(model, argparse.Namespace(**{**vars(args), "prompt_len": 8, "new_tokens": 3}), 1)  # warm-up
    rows = []
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        prefill_s, decode_step_s = run_engine(model, args, batch)
        mean_context = args.prompt_len + args.new_tokens // 2
        decode_bytes = step_bytes(model, args.stage, batch, batch * mean_context)
        decode_floor_s = decode_bytes / bandwidth
        prefill_tokens = batch * args.prompt_len
        prefill_steps = -(-prefill_tokens // args.max_num_batched_tokens)
        prefill_floor_s = prefill_steps * step_bytes(model, args.stage, min(prefill_tokens, args.max_num_batched_tokens),
                                                     0) / bandwidth
        rows.append(dict(
            batch=batch, decode_tok_s=batch / decode_step_s, decode_step_ms=1e3 * decode_step_s,
            decode_floor_ms=1e3 * decode_floor_s, decode_floor_tok_s=batch / decode_floor_s,
            decode_gb_s=decode_bytes / decode_step_s / 1e9,
            prefill_tok_s=prefill_tokens / prefill_s, prefill_floor_tok_s=prefill_tokens / prefill_floor_s,
        ))
    header = (f"{'batch':>5} {'decode tok/s':>13} {'step ms':>9} {'floor ms':>9} {'floor tok/s':>12} "
              f"{'GB/s':>8} {'prefill tok/s':>14} {'floor tok/s':>12}")
    print(f"stage={args.stage} device={args.device} dtype={args.dtype} model={args.checkpoint or args.config} "
          f"params={sum(p.numel() for p in model.parameters()) / 1e9:.3f}B copy={bandwidth / 1e9:.1f} GB/s "
          f"prompt={args.prompt_len}")
    print(header)
    for r in rows:
        print(f"{r['batch']:>5} {r['decode_tok_s']:>13.1f} {r['decode_step_ms']:>9.2f} {r['decode_floor_ms']:>9.3f} "
              f"{r['decode_floor_tok_s']:>12.1f} {r['decode_gb_s']:>8.2f} {r['prefill_tok_s']:>14.1f} "
              f"{r['prefill_floor_tok_s']:>12.1f}")
    result = dict(stage=args.stage, device=args.device, dtype=args.dtype, model=args.checkpoint or args.config, layers=args.layers,
                  copy_bandwidth_gb_s=bandwidth / 1e9, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                  rows=rows)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
