"""Write a tiny random-weight Qwen3-Omni checkpoint in the released on-disk format.

The checkpoint has the real architecture (MoE thinker with q/k norm and M-RoPE, MoE talker with a
shared expert, MTP code predictor, Code2Wav, audio encoder) at toy widths, so every code path of the
server runs on a laptop. It is written by transformers' own ``save_pretrained`` so tensor names,
sharding index and config keys are exactly what a downloaded checkpoint has.

    python -m omni_triton.checkpoints.tiny --out checkpoints/tiny
    omni-triton build tiny --out checkpoints/tiny
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from omni_triton.checkpoints.transformers_rope_keys import quiet_mrope_key_warning
from omni_triton.checkpoints.tokenizer import SPECIAL_TOKENS, build_tokenizer, write_tokenizer_files

# Presets differ in layer counts and code-group counts so nothing downstream is hard-wired to one shape.
# talker_extra_codes: talker ids between the codebook and the 1024 control ids. The released talker has none,
# but a checkpoint may (transformers only requires vocab >= codebook + 1024); the talker can emit them as a
# frame's first code, and Code2Wav decodes them with the next quantizer's embedding rows.
PRESETS = {
    "tiny": dict(thinker_layers=4, accept_hidden_layer=2, talker_layers=2, predictor_layers=2,
                 code_groups=16, code2wav_layers=2, audio_layers=2, seed=0, talker_extra_codes=0),
    "tiny-8g": dict(thinker_layers=3, accept_hidden_layer=3, talker_layers=3, predictor_layers=1,
                    code_groups=8, code2wav_layers=1, audio_layers=1, seed=1, talker_extra_codes=0),
    "tiny-wide-talker": dict(thinker_layers=4, accept_hidden_layer=2, talker_layers=2, predictor_layers=2,
                             code_groups=16, code2wav_layers=2, audio_layers=2, seed=0, talker_extra_codes=64),
}

CODEBOOK_SIZE = 128
STAMP_FILE = "tiny_checkpoint.json"  # written last: its presence marks a complete, random-weight checkpoint
# Codec special ids sit in the top 1024 talker ids, at the released checkpoint's offsets from the codebook.
CODEC_SPECIAL_OFFSETS = dict(codec_pad_id=100, codec_bos_id=101, codec_eos_token_id=102,
                             codec_nothink_id=107, codec_think_bos_id=108, codec_think_eos_id=109)
SPEAKER_OFFSETS = {"chelsie": 253, "ethan": 254, "aiden": 255}


def make_config_dict(preset: str, token_ids: dict[str, int], vocab_size: int) -> dict:
    p = PRESETS[preset]
    hidden, head_dim = 64, 16
    thinker_text = dict(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=128, num_hidden_layers=p["thinker_layers"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, hidden_act="silu",
        max_position_embeddings=4096, rms_norm_eps=1e-6, attention_bias=False,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0, mrope_section=[2, 3, 3],
                             mrope_interleaved=True, interleaved=True),
        decoder_sparse_step=1, moe_intermediate_size=32, num_experts_per_tok=2, num_experts=8,
        norm_topk_prob=True, mlp_only_layers=[],
    )
    audio = dict(
        num_mel_bins=128, encoder_layers=p["audio_layers"], encoder_attention_heads=4, encoder_ffn_dim=64,
        d_model=32, activation_function="gelu", max_source_positions=1500, n_window=50, output_dim=hidden,
        n_window_infer=400, conv_chunksize=500, downsample_hidden_size=16,
    )
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=hidden,
                  patch_size=16, spatial_merge_size=2, temporal_patch_size=2, deepstack_visual_indexes=[0],
                  num_position_embeddings=64)
    thinker = dict(
        text_config=thinker_text, audio_config=audio, vision_config=vision,
        audio_token_id=token_ids["<|audio_pad|>"], image_token_id=token_ids["<|image_pad|>"],
        video_token_id=token_ids["<|video_pad|>"], audio_start_token_id=token_ids["<|audio_start|>"],
        vision_start_token_id=token_ids["<|vision_start|>"], user_token_id=token_ids["user"],
        position_id_per_seconds=25,
    )
    codec = {k: CODEBOOK_SIZE + off for k, off in CODEC_SPECIAL_OFFSETS.items()}
    talker_vocab = CODEBOOK_SIZE + p["talker_extra_codes"] + 1024
    talker_text = dict(
        vocab_size=talker_vocab, hidden_size=hidden, intermediate_size=128, num_hidden_layers=p["talker_layers"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, hidden_act="silu",
        max_position_embeddings=4096, rms_norm_eps=1e-6,
        rope_parameters=dict(rope_type="default", rope_theta=1000000.0, mrope_section=[2, 3, 3],
                             mrope_interleaved=True, interleaved=True),
        moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts_per_tok=2, num_experts=8,
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
    )
    predictor = dict(
        vocab_size=CODEBOOK_SIZE, hidden_size=hidden, intermediate_size=128, num_hidden_layers=p["predictor_layers"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, hidden_act="silu",
        max_position_embeddings=64, rms_norm_eps=1e-6, rope_parameters=dict(rope_type="default", rope_theta=1000000.0),
        num_code_groups=p["code_groups"],
    )
    talker = dict(
        text_config=talker_text, code_predictor_config=predictor, num_code_groups=p["code_groups"],
        thinker_hidden_size=hidden, accept_hidden_layer=p["accept_hidden_layer"],
        audio_token_id=token_ids["<|audio_pad|>"], image_token_id=token_ids["<|image_pad|>"],
        video_token_id=token_ids["<|video_pad|>"], vision_start_token_id=token_ids["<|vision_start|>"],
        audio_start_token_id=token_ids["<|audio_start|>"], position_id_per_seconds=25,
        speaker_id={name: CODEBOOK_SIZE + off for name, off in SPEAKER_OFFSETS.items()}, spatial_merge_size=2,
        **codec,
    )
    code2wav = dict(
        codebook_size=CODEBOOK_SIZE, hidden_size=hidden, max_position_embeddings=8000,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0), num_attention_heads=4,
        num_key_value_heads=4, sliding_window=72, intermediate_size=128, hidden_act="silu",
        layer_scale_initial_scale=0.01, rms_norm_eps=1e-5, num_hidden_layers=p["code2wav_layers"],
        num_quantizers=p["code_groups"], upsample_rates=[8, 5, 4, 3], upsampling_ratios=[2, 2], decoder_dim=64,
    )
    return dict(
        architectures=["Qwen3OmniMoeForConditionalGeneration"], model_type="qwen3_omni_moe",
        thinker_config=thinker, talker_config=talker, code2wav_config=code2wav, enable_audio_output=True,
        im_start_token_id=token_ids["<|im_start|>"], im_end_token_id=token_ids["<|im_end|>"],
        tts_pad_token_id=token_ids["<tts_pad>"], tts_bos_token_id=token_ids["<tts_text_bos>"],
        tts_eos_token_id=token_ids["<tts_text_eod>"], system_token_id=token_ids["system"],
        user_token_id=token_ids["user"], assistant_token_id=token_ids["assistant"],
    )


def rerandomise_(model: torch.nn.Module, seed: int) -> None:
    """Give every tensor a fresh, well-scaled random value.

    transformers' init leaves some tensors (the talker's fused experts) uninitialised and zeroes others
    (routers, layer scales), which makes outputs degenerate; deterministic fan-in scaling keeps
    activations O(1) through every stage, so greedy decoding produces varied tokens and audible audio.
    """
    generator = torch.Generator().manual_seed(seed)
    for name, tensor in sorted(model.state_dict().items()):
        if not tensor.is_floating_point():
            continue
        if name.endswith("norm.weight") or "norm" in name.split(".")[-2] and name.endswith("weight"):
            value = 1.0 + 0.1 * torch.randn(tensor.shape, generator=generator)
        elif name.endswith(("alpha", "beta")):  # SnakeBeta keeps log-scale parameters near 0
            value = 0.1 * torch.randn(tensor.shape, generator=generator)
        elif "layer_scale" in name or name.endswith(".scale"):
            value = 0.1 + 0.02 * torch.randn(tensor.shape, generator=generator)
        elif tensor.dim() >= 2:
            fan_in = tensor[0].numel() if tensor.dim() != 3 or "experts" not in name else tensor.shape[-1]
            value = torch.randn(tensor.shape, generator=generator) / math.sqrt(max(fan_in, 1))
            if name.startswith("code2wav.decoder.") and ".conv2." in name:
                # 12 residual units (x + branch) compound the vocoder's gain ~2.5x per decoder block;
                # damped branches keep the waveform in range instead of clamped to +-1
                value = value * 0.1
        else:
            value = 0.02 * torch.randn(tensor.shape, generator=generator)
        with torch.no_grad():
            tensor.copy_(value.to(tensor.dtype))


def build(out_dir: Path, preset: str = "tiny", *, force: bool = False) -> Path:
    """Build the checkpoint into ``out_dir`` (skipped when it is already complete, unless ``force``)."""
    from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

    out_dir = Path(out_dir)
    stamp = out_dir / STAMP_FILE
    if stamp.exists() and not force and json.loads(stamp.read_text()).get("preset") == preset:
        return out_dir
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    out_dir.mkdir(parents=True, exist_ok=True)

    tokenizer = build_tokenizer()
    token_ids = {tok: tokenizer.token_to_id(tok) for tok in [*SPECIAL_TOKENS, "user", "assistant", "system"]}
    with quiet_mrope_key_warning():
        config = Qwen3OmniMoeConfig(**make_config_dict(preset, token_ids,
                                                       vocab_size=_padded(tokenizer.get_vocab_size())))
        torch.manual_seed(PRESETS[preset]["seed"])
        model = Qwen3OmniMoeForConditionalGeneration(config).eval()
    rerandomise_(model, PRESETS[preset]["seed"])
    model.save_pretrained(out_dir, safe_serialization=True)
    write_tokenizer_files(tokenizer, out_dir)
    generation = dict(eos_token_id=[token_ids["<|im_end|>"], token_ids["<|endoftext|>"]],
                      pad_token_id=token_ids["<|endoftext|>"])
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    stamp.write_text(json.dumps({"preset": preset, "seed": PRESETS[preset]["seed"]}) + "\n")
    return out_dir


def is_random_weight_checkpoint(checkpoint_dir: str | Path) -> bool:
    """Whether this builder wrote ``checkpoint_dir`` (random weights: its text and audio are noise)."""
    return (Path(checkpoint_dir) / STAMP_FILE).is_file()


def _padded(vocab_size: int, multiple: int = 64) -> int:
    return (vocab_size + multiple - 1) // multiple * multiple


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="checkpoints/tiny", help="output directory (default: %(default)s)")
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--force", action="store_true", help="rebuild even if the directory is complete")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    out = build(Path(args.out), args.preset, force=args.force)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"tiny checkpoint ({args.preset}) at {out}: {size / 1e6:.1f} MB in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
