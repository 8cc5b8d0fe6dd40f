"""FP8 weights against the bf16 path on the same weights: thinker greedy agreement and logit KL, talker codes, audio.

    python -m omni_triton.bench.fp8_accuracy --checkpoint checkpoints/tiny --out fp8_accuracy.json
    python -m omni_triton.bench.fp8_accuracy --config qwen3_omni_30b_a3b --device cuda --weights heavy-tailed

The reference is the model in ``--dtype`` (bf16) on the torch path; its FP8 twin quantizes the same tensors at
load (``layers.fp8.quantized_copy``: block-FP8, 128 x 128 blocks, the modules ``--quantization fp8`` converts) and
runs the same path, its weights dequantized per call. Over a fixed prompt set (``PROMPTS``, chat-formatted):

- thinker: the bf16 model's greedy continuation (``--tokens`` tokens, EOS ignored); then both models score
  prompt + that continuation in one prefill: teacher-forced greedy agreement (the FP8 argmax equals the bf16
  token) and the mean KL(bf16 || FP8) of the next-token distributions over those positions; and the FP8 model's
  own greedy continuation: tokens equal position by position, and the first position where it leaves the bf16 one.
- the same thinker measures of the reference against the fp32 model (with ``--dtype bfloat16``, ``--fp32-floor on``):
  the floor that the reference's own rounding sets.
- talker (``--talker-prompts`` of them, the bf16 thinker's text in both runs): greedy codes of the bf16 talker and
  of the FP8 talker: codes equal over the common frames (all code groups), frames each, and the relative L2
  difference of the two waveforms Code2Wav (bf16, not quantized) decodes from them. Served, the talker stays bf16
  (``models.quantization.served_in_fp8``): these measure the FP8 talker that policy declines (``fp8_everywhere``).

``--weights``: ``as-loaded`` (the checkpoint's or the seeded random weights), or ``heavy-tailed``: every tensor the
FP8 twin quantizes redrawn with a trained model's shape of statistics instead of a Gaussian's: Student-t entries
(4 degrees of freedom: kurtosis well above a Gaussian's) times a log-normal scale per input channel (sigma 0.5:
some channels several times louder, the outlier features of trained LLMs), each matrix rescaled to its original
RMS. Random weights, Gaussian or not, have no learned structure: the agreement they give is not a trained model's.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from omni_triton.models.config import OmniConfig
from omni_triton.models.layers.attention import contiguous_batch
from omni_triton.models.layers.fp8 import quantized_copy
from omni_triton.models.quantization import quantized_at_load
from omni_triton.models.weights import load_code2wav, load_talker, load_thinker
from omni_triton.pipeline.chat import ChatTokenizer
from omni_triton.pipeline.reference import chunked_decode, generate

SUBJECTS = ["the weather tomorrow", "a recipe for bread", "how tides work", "the history of tea", "a bedtime story",
            "prime numbers", "learning to swim", "the moon landing", "how to fix a bike", "jazz music",
            "saving money", "volcanoes", "a trip to Kyoto", "photosynthesis", "chess openings", "kind neighbours"]
ASKS = ["Tell me about {}.", "Explain {} simply.", "Write two sentences on {}.", "What should I know about {}?"]
PROMPTS = [ask.format(subject) for ask in ASKS for subject in SUBJECTS]  # 64 fixed prompts


def heavy_tailed_(model: torch.nn.Module, seed: int) -> None:
    """Redraw the tensors the FP8 twin quantizes (see the module docstring)."""
    generator = torch.Generator().manual_seed(seed)
    student = torch.distributions.StudentT(4.0)
    with torch.no_grad():
        for name, module in model.named_modules():
            if not quantized_at_load(name, module):
                continue
            weights = [module.weight] if hasattr(module, "weight") else [module.gate_up_proj, module.down_proj]
            for weight in weights:
                rms = weight.float().pow(2).mean().sqrt()
                torch.manual_seed(int(torch.randint(0, 2 ** 31, (1,), generator=generator)))
                values = student.sample(weight.shape)
                values = values * torch.exp(0.5 * torch.randn(weight.shape[-1], generator=generator))
                weight.copy_((values * rms / values.pow(2).mean().sqrt()).to(weight.dtype))


def _logits(thinker, ids: list[int]) -> torch.Tensor:
    device = thinker.lm_head.weight.device
    batch = contiguous_batch([len(ids)], thinker.num_layers, thinker.num_kv_heads, thinker.head_dim,
                             dtype=thinker.lm_head.weight.dtype, device=device)
    tokens = torch.tensor(ids, device=device)
    hidden, _ = thinker(thinker.embed(tokens), torch.arange(len(ids), device=device)[None].expand(3, -1), batch)
    return thinker.compute_logits(hidden)


def _greedy(thinker, config: OmniConfig, prompt: list[int], tokens: int) -> list[int]:
    output = generate(thinker, None, config, prompt, return_audio=False, thinker_max_new_tokens=tokens,
                      thinker_eos_token_ids=())
    return output.thinker_ids


@torch.no_grad()
def thinker_agreement(reference, quantized, config: OmniConfig, prompts: list[list[int]], tokens: int,
                      continuations: dict | None = None) -> dict:
    """``continuations``: greedy continuations already made, by (model id, prompt), reused and added to (the floor's
    bf16 model is the FP8 comparison's reference)."""
    continuations = {} if continuations is None else continuations

    def greedy(model, prompt):
        key = (id(model), tuple(prompt))
        if key not in continuations:
            continuations[key] = _greedy(model, config, prompt, tokens)
        return continuations[key]

    agree = total = free_agree = 0
    kl_sum, top1_sum, first_divergence = 0.0, 0.0, []
    for prompt in prompts:
        continuation = greedy(reference, prompt)
        sequence = prompt + continuation
        scored = slice(len(prompt) - 1, len(sequence) - 1)  # the positions that predicted the continuation
        log_ref = torch.log_softmax(_logits(reference, sequence)[scored].float(), dim=-1)
        log_fp8 = torch.log_softmax(_logits(quantized, sequence)[scored].float(), dim=-1)
        kl_sum += float((log_ref.exp() * (log_ref - log_fp8)).sum())
        top1_sum += float(log_ref.max(dim=-1).values.exp().sum())
        agree += int((log_fp8.argmax(dim=-1) == torch.tensor(continuation, device=log_fp8.device)).sum())
        total += len(continuation)
        own = greedy(quantized, prompt)
        matches = [a == b for a, b in zip(own, continuation)]
        free_agree += sum(matches)
        first_divergence.append(matches.index(False) if False in matches else len(matches))
    return {"prompts": len(prompts), "tokens_per_prompt": tokens,
            "teacher_forced_agreement": agree / total, "mean_kl": kl_sum / total,
            "reference_mean_top1_probability": top1_sum / total,
            "free_running_agreement": free_agree / total,
            "mean_first_divergence": sum(first_divergence) / len(first_divergence),
            "identical_continuations": sum(d == tokens for d in first_divergence) / len(first_divergence)}


@torch.no_grad()
def talker_agreement(thinker, reference, quantized, code2wav, config: OmniConfig, prompts: list[list[int]],
                     thinker_tokens: int, frames: int) -> dict:
    equal = compared = 0
    frame_counts, audio_errors = [], []
    for prompt in prompts:
        runs = [generate(thinker, talker, config, prompt, code2wav=code2wav, thinker_max_new_tokens=thinker_tokens,
                         thinker_eos_token_ids=(), talker_max_new_tokens=frames) for talker in (reference, quantized)]
        codes = [run.codes for run in runs]
        common = min(c.shape[1] for c in codes)
        equal += int((codes[0][:, :common] == codes[1][:, :common]).sum())
        compared += codes[0].shape[0] * common
        frame_counts.append([c.shape[1] for c in codes])
        if runs[0].waveform is not None and runs[1].waveform is not None:
            samples = min(runs[0].waveform.numel(), runs[1].waveform.numel())
            want, got = runs[0].waveform[:samples].float(), runs[1].waveform[:samples].float()
            audio_errors.append(float((got - want).norm() / want.norm().clamp_min(1e-12)))
    return {"prompts": len(prompts), "max_frames": frames, "code_agreement": equal / max(compared, 1),
            "frames_bf16_fp8": frame_counts,
            "mean_audio_relative_l2": sum(audio_errors) / len(audio_errors) if audio_errors else None}


def run(checkpoint: str | Path, *, load_format: str = "safetensors", device: str = "cpu",
        dtype: torch.dtype = torch.bfloat16, weights: str = "as-loaded", prompts: int = 64, tokens: int = 100,
        talker_prompts: int = 8, talker_frames: int = 32, seed: int = 0, fp32_floor: bool = True) -> dict:
    config = OmniConfig.from_pretrained(checkpoint)
    chat = ChatTokenizer.from_checkpoint(checkpoint)
    prompt_ids = [chat.encode_prompt(text) for text in PROMPTS[:prompts]]
    loaded = dict(load_format=load_format, seed=seed)
    thinker = load_thinker(checkpoint, device, dtype, with_audio=False, **loaded)
    talker = load_talker(checkpoint, device, dtype, **loaded)
    if weights == "heavy-tailed":
        heavy_tailed_(thinker, seed)
        heavy_tailed_(talker, seed + 1)
    made: dict = {}  # greedy continuations, shared by the two comparisons
    result = {"checkpoint": str(checkpoint), "load_format": load_format, "weights": weights, "dtype": str(dtype),
              "device": device, "seed": seed,
              "thinker": thinker_agreement(thinker, quantized_copy(thinker), config, prompt_ids, tokens, made)}
    if fp32_floor and dtype != torch.float32:  # the same measure of the reference itself against fp32: the floor FP8 sits on
        full = load_thinker(checkpoint, device, torch.float32, with_audio=False, **loaded)
        if weights == "heavy-tailed":
            heavy_tailed_(full, seed)
        result["thinker_fp32_vs_reference"] = thinker_agreement(full, thinker, config, prompt_ids, tokens, made)
    code2wav = load_code2wav(checkpoint, device, dtype, **loaded)
    result["talker"] = talker_agreement(thinker, talker, quantized_copy(talker), code2wav, config,
                                        prompt_ids[:talker_prompts], min(tokens, 24), talker_frames)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--checkpoint", type=Path, help="checkpoint dir (default: the tiny random-weight one)")
    source.add_argument("--config", help="random weights (load format dummy) of this checkpoint dir or shipped "
                                          "config name (default: none)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="the reference's dtype (default: %(default)s)")
    parser.add_argument("--weights", choices=["as-loaded", "heavy-tailed"], default="as-loaded",
                        help="the weights as loaded, or redrawn with a trained model's statistics (see the module "
                             "docstring) (default: %(default)s)")
    parser.add_argument("--prompts", type=int, default=64, help="thinker prompts, at most 64 (default: %(default)s)")
    parser.add_argument("--tokens", type=int, default=100, help="greedy tokens per prompt (default: %(default)s)")
    parser.add_argument("--talker-prompts", type=int, default=8, help="talker prompts (default: %(default)s)")
    parser.add_argument("--talker-frames", type=int, default=32, help="talker frames at most (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="dummy and heavy-tailed weights' seed (default: "
                                                            "%(default)s)")
    parser.add_argument("--fp32-floor", choices=["on", "off"], default="on",
                        help="also measure the reference against the fp32 model (off where the model in fp32 does "
                             "not fit beside it, e.g. full size on one GPU) (default: %(default)s)")
    parser.add_argument("--out", type=Path, help="write the result as JSON here too (default: print only)")
    args = parser.parse_args(argv)
    if args.config:
        from omni_triton.checkpoints.dummy import build as dummy_dir

        checkpoint, load_format = dummy_dir(args.config), "dummy"
    else:
        from omni_triton.checkpoints.tiny import build as tiny

        checkpoint, load_format = args.checkpoint or tiny(Path("checkpoints/tiny")), "safetensors"
    torch.set_grad_enabled(False)
    result = run(checkpoint, load_format=load_format, device=args.device, dtype=getattr(torch, args.dtype),
                 weights=args.weights, prompts=min(args.prompts, len(PROMPTS)), tokens=args.tokens,
                 talker_prompts=args.talker_prompts, talker_frames=args.talker_frames, seed=args.seed,
                 fp32_floor=args.fp32_floor == "on")
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    if not math.isfinite(result["thinker"]["mean_kl"]):
        raise SystemExit("the FP8 model's logits are not finite")


if __name__ == "__main__":
    main()
