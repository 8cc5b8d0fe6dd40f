"""16 kHz waveform -> Whisper-style 128-bin log-mel features, as Qwen3-Omni's processor computes them.

Matches transformers' ``WhisperFeatureExtractor`` with the released ``preprocessor_config.json``
(feature_size 128, n_fft 400, hop_length 160, sampling_rate 16000, dither 0) called the way
``Qwen3OmniMoeProcessor`` calls it (``padding=True``: pad a batch to its longest waveform with zeros,
no truncation): centred (reflect-padded) Hann STFT, power spectrum, Slaney mel filters 0-8 kHz,
log10 floored at 1e-10, the last STFT frame dropped, then per waveform ``max(x, x.max() - 8)`` and
``(x + 4) / 4``. A waveform of L samples yields L // 160 feature frames.
"""

from __future__ import annotations

import math

import numpy as np
import torch

SAMPLING_RATE = 16000
N_FFT = 400
HOP_LENGTH = 160
NUM_MEL_BINS = 128


def _hz_to_mel_slaney(freq: np.ndarray) -> np.ndarray:
    mels = 3.0 * freq / 200.0
    log_region = freq >= 1000.0
    mels[log_region] = 15.0 + np.log(freq[log_region] / 1000.0) * (27.0 / math.log(6.4))
    return mels


def _mel_to_hz_slaney(mels: np.ndarray) -> np.ndarray:
    freq = 200.0 * mels / 3.0
    log_region = mels >= 15.0
    freq[log_region] = 1000.0 * np.exp((math.log(6.4) / 27.0) * (mels[log_region] - 15.0))
    return freq


def slaney_mel_filters(num_mel_bins: int = NUM_MEL_BINS, n_fft: int = N_FFT,
                       sampling_rate: int = SAMPLING_RATE) -> torch.Tensor:
    """Triangular Slaney-normalised mel filters over 0 .. sampling_rate/2: [n_fft // 2 + 1, num_mel_bins]."""
    mel_edges = np.linspace(_hz_to_mel_slaney(np.array([0.0]))[0],
                            _hz_to_mel_slaney(np.array([sampling_rate / 2.0]))[0], num_mel_bins + 2)
    hz_edges = _mel_to_hz_slaney(mel_edges)
    fft_freqs = np.linspace(0, sampling_rate // 2, n_fft // 2 + 1)
    slopes = hz_edges[None, :] - fft_freqs[:, None]
    widths = np.diff(hz_edges)
    down = -slopes[:, :-2] / widths[:-1]
    up = slopes[:, 2:] / widths[1:]
    filters = np.maximum(0.0, np.minimum(down, up))
    filters *= 2.0 / (hz_edges[2:] - hz_edges[:-2])[None, :]
    return torch.from_numpy(filters).float()


class LogMelExtractor:
    """Batched log-mel features on any torch device (filters cached per device)."""

    def __init__(self, num_mel_bins: int = NUM_MEL_BINS, n_fft: int = N_FFT, hop_length: int = HOP_LENGTH,
                 sampling_rate: int = SAMPLING_RATE):
        self.n_fft, self.hop_length = n_fft, hop_length
        self._filters = {torch.device("cpu"): slaney_mel_filters(num_mel_bins, n_fft, sampling_rate)}

    def num_frames(self, num_samples: int) -> int:
        return num_samples // self.hop_length

    def __call__(self, waveforms: list[torch.Tensor] | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Waveforms (a list of 1-D float tensors, or one 1-D tensor) at ``sampling_rate``
        -> (features [B, num_mel_bins, T] zero-padded past each length, lengths LongTensor [B])."""
        if isinstance(waveforms, torch.Tensor):
            if waveforms.dim() != 1:
                raise ValueError(f"a single waveform must be 1-D, got shape {tuple(waveforms.shape)}")
            waveforms = [waveforms]
        for i, wav in enumerate(waveforms):
            if wav.dim() != 1 or wav.numel() < self.n_fft // 2 + 1:
                raise ValueError(f"waveform {i} must be 1-D with > {self.n_fft // 2} samples, got {tuple(wav.shape)}")
        device = waveforms[0].device
        # The processor pads a batch to its longest waveform before the STFT, so a shorter waveform's tail
        # frames see zeros rather than reflection padding; do the same to match it exactly.
        batch = torch.nn.utils.rnn.pad_sequence([w.float() for w in waveforms], batch_first=True)
        window = torch.hann_window(self.n_fft, device=device)
        stft = torch.stft(batch, self.n_fft, self.hop_length, window=window, return_complex=True)
        power = stft[..., :-1].abs() ** 2  # [B, F, T]
        if device not in self._filters:
            self._filters[device] = self._filters[torch.device("cpu")].to(device)
        mel = self._filters[device].T @ power
        log_mel = mel.clamp(min=1e-10).log10()
        peak = log_mel.amax(dim=(1, 2), keepdim=True)
        log_mel = (torch.maximum(log_mel, peak - 8.0) + 4.0) / 4.0
        lengths = torch.tensor([self.num_frames(w.numel()) for w in waveforms], dtype=torch.long, device=device)
        valid = torch.arange(log_mel.shape[-1], device=device)[None, :] < lengths[:, None]
        return log_mel * valid[:, None, :], lengths
