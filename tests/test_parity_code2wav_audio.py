"""Parity of the audio modules with transformers on the tiny checkpoints (fp32, CPU).

Code2Wav waveform vs HF Qwen3OmniMoeCode2Wav on both presets (16 and 8 code groups) at frame counts below,
at and above the sliding window; log-mel features vs WhisperFeatureExtractor configured as Qwen3-Omni's
preprocessor_config.json; audio encoder vs the thinker's audio tower; audio token counts and placement.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from _code2wav_helpers import one_torch_thread, stateful_decode  # noqa: F401 (fixture)
from omni_triton.checkpoints.tiny import build
from omni_triton.models.audio_encoder import num_audio_tokens, num_audio_tokens_for_samples, scatter_audio_embeddings
from omni_triton.models.audio_features import LogMelExtractor
from omni_triton.models.weights import CODE2WAV_PREFIX, load_audio_encoder, load_code2wav
from omni_triton.models.weights import load_component_
from omni_triton.models.code2wav.vocoder import Code2Wav
from omni_triton.models.code2wav.stateful import StreamingCode2Wav

pytestmark = [pytest.mark.parity, pytest.mark.usefixtures("one_torch_thread")]
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", params=["tiny", "tiny-8g"])
def checkpoint(request, tmp_path_factory):
    return build(tmp_path_factory.mktemp(request.param), request.param), request.param


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    model = transformers.Qwen3OmniMoeForConditionalGeneration.from_pretrained(checkpoint[0], dtype=torch.float32)
    return model.eval()


def chirp(seconds: float, f0: float = 200.0, f1: float = 3000.0, amplitude: float = 0.5) -> np.ndarray:
    t = np.arange(int(seconds * 16000)) / 16000.0
    return (amplitude * np.sin(2 * np.pi * (f0 * t + (f1 - f0) / (2 * seconds) * t * t))).astype(np.float32)


def qwen3_omni_feature_extractor():
    # Qwen3-Omni's preprocessor_config.json (feature_size 128, hop 160, n_fft 400, n_samples 4800000)
    return transformers.WhisperFeatureExtractor(feature_size=128, sampling_rate=16000, hop_length=160,
                                                chunk_length=300, n_fft=400, padding_value=0.0,
                                                return_attention_mask=True)


def hf_features(waveforms: list[np.ndarray]):
    # the call Qwen3OmniMoeProcessor makes (its audio_kwargs)
    return qwen3_omni_feature_extractor()(waveforms, sampling_rate=16000, padding=True, truncation=False,
                                          return_attention_mask=True, return_tensors="pt")


def test_code2wav_matches_hf(checkpoint, hf_model):
    ours = load_code2wav(checkpoint[0])
    window = ours.sliding_window
    generator = torch.Generator().manual_seed(0)
    for batch, num_frames in [(2, 5), (2, window), (1, window + 1), (1, 2 * window + 6)]:
        codes = torch.randint(0, ours.config.codebook_size, (batch, ours.num_quantizers, num_frames),
                              generator=generator)
        with torch.inference_mode():
            expected = hf_model.code2wav(codes).squeeze(1)
            actual = ours(codes)
        assert actual.shape == expected.shape == (batch, ours.output_length(num_frames))
        assert (actual - expected).abs().max().item() <= 1e-4, f"{num_frames} frames"


def test_stateful_streaming_matches_hf_one_pass(checkpoint, hf_model):
    """Chunks decoded with carried state (the ramp, then 1-frame chunks) vs HF's one-pass Code2Wav."""
    ours = load_code2wav(checkpoint[0])
    split = [4, 8, 24, 25, 1, 1, 3]
    codes = torch.randint(0, ours.config.codebook_size, (2, ours.num_quantizers, sum(split)),
                          generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        expected = hf_model.code2wav(codes).squeeze(1)
    streamed = stateful_decode(StreamingCode2Wav(ours), codes, [split, split[::-1]])
    for row in range(2):
        assert streamed[row].shape == expected[row].shape
        assert (streamed[row] - expected[row]).abs().max().item() <= 1e-4


def test_code2wav_loading_is_strict(checkpoint):
    model = Code2Wav(load_code2wav(checkpoint[0]).config)
    model.extra = torch.nn.Linear(2, 2)  # a tensor the checkpoint does not have
    with pytest.raises(ValueError, match="missing.*code2wav.extra.weight"):
        load_component_(model, checkpoint[0], CODE2WAV_PREFIX)


def test_log_mel_matches_whisper_feature_extractor():
    waveforms = [chirp(1.3), chirp(0.77, 300, 1000), chirp(4.5, amplitude=0.05)]
    expected = hf_features(waveforms)
    features, lengths = LogMelExtractor()([torch.from_numpy(w) for w in waveforms])
    assert lengths.tolist() == expected["attention_mask"].sum(-1).tolist()
    assert features.shape == expected["input_features"].shape
    valid = expected["attention_mask"].bool()
    error = (features - expected["input_features"]).abs().transpose(1, 2)[valid]
    assert error.max().item() <= 1e-5
    single, _ = LogMelExtractor()(torch.from_numpy(waveforms[0]))
    assert (single - hf_features([waveforms[0]])["input_features"]).abs().max().item() <= 1e-5


def test_audio_token_count_matches_hf():
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

    lengths = torch.arange(0, 1300)
    assert torch.equal(num_audio_tokens(lengths, 50), _get_feat_extract_output_lengths(lengths, 50))
    assert [num_audio_tokens(int(n), 50) for n in (1, 99, 100, 101, 1299)] == \
        _get_feat_extract_output_lengths(torch.tensor([1, 99, 100, 101, 1299]), 50).tolist()
    # waveform -> tokens the way Qwen3OmniMoeProcessor counts them (feature mask length, then the formula)
    for seconds in (0.3, 1.0, 1.3, 4.51):
        mask = hf_features([chirp(seconds)])["attention_mask"]
        expected = _get_feat_extract_output_lengths(mask.sum(-1), 50).item()
        assert num_audio_tokens_for_samples(int(seconds * 16000)) == expected


def test_audio_encoder_matches_hf_audio_tower(checkpoint, hf_model):
    # 4.5 s = 450 frames = 59 tokens: more than one attention window (52 tokens at n_window_infer 400)
    waveforms = [chirp(1.3), chirp(4.5, 100, 6000), chirp(0.5, 500, 700)]
    inputs = hf_features(waveforms)
    with torch.inference_mode():
        expected = hf_model.thinker.get_audio_features(
            inputs["input_features"], feature_attention_mask=inputs["attention_mask"]).last_hidden_state
        encoder = load_audio_encoder(checkpoint[0])
        features, lengths = LogMelExtractor()([torch.from_numpy(w) for w in waveforms])
        actual = encoder(features, lengths)
    assert actual.shape == expected.shape
    assert actual.shape[0] == int(encoder.num_tokens(lengths).sum())
    assert (actual - expected).abs().max().item() <= 1e-5


def test_audio_embeddings_land_on_audio_tokens(checkpoint, hf_model):
    audio_id = hf_model.config.thinker_config.audio_token_id
    input_ids = torch.tensor([5, 6, audio_id, audio_id, audio_id, 7, audio_id, 8])
    embeds = torch.randn(8, 16)
    audio = torch.randn(4, 16)
    expected = embeds.masked_scatter((input_ids == audio_id)[:, None].expand_as(embeds), audio)
    assert torch.equal(scatter_audio_embeddings(embeds, input_ids, audio_id, audio), expected)
    with pytest.raises(ValueError, match="4 audio tokens"):
        scatter_audio_embeddings(embeds, input_ids, audio_id, audio[:3])
