"""Load the audio modules (Code2Wav vocoder, thinker audio encoder) from an HF-format checkpoint.

Through the same streaming, strict loader as the thinker and talker (``weights.load_component_``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from omni_triton.models.audio_encoder import AudioEncoder, AudioEncoderConfig
from omni_triton.models.code2wav import Code2Wav, Code2WavConfig
from omni_triton.models.weights import load_component_

CODE2WAV_PREFIX = "code2wav."
AUDIO_ENCODER_PREFIX = "thinker.audio_tower."


def load_code2wav(checkpoint_dir: str | Path, device: str | torch.device = "cpu",
                  dtype: torch.dtype = torch.float32) -> Code2Wav:
    # built on the device (not on "meta"): its non-persistent buffers are computed in __init__
    config = Code2WavConfig.from_pretrained(checkpoint_dir)
    with torch.device(device):
        model = Code2Wav(config).to(dtype)
    return load_component_(model, checkpoint_dir, CODE2WAV_PREFIX).eval()


def load_audio_encoder(checkpoint_dir: str | Path, device: str | torch.device = "cpu",
                       dtype: torch.dtype = torch.float32) -> AudioEncoder:
    config = AudioEncoderConfig.from_pretrained(checkpoint_dir)
    with torch.device(device):
        model = AudioEncoder(config).to(dtype)
    return load_component_(model, checkpoint_dir, AUDIO_ENCODER_PREFIX).eval()
