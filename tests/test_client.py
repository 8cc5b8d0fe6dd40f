"""The streaming client's pieces that need no server: WAV files, resampling, request tensors, metrics."""

from __future__ import annotations

import wave

import numpy as np
import pytest

from omni_triton.client import StreamResult, build_inputs, read_wav, resample, write_wav


def test_wav_round_trip_is_16_bit_mono_at_the_given_rate(tmp_path):
    audio = np.sin(np.linspace(0, 60, 24000, dtype=np.float32)) * 0.5
    write_wav(tmp_path / "a.wav", np.concatenate([audio, [2.0, -2.0]]).astype(np.float32))
    with wave.open(str(tmp_path / "a.wav")) as written:
        assert (written.getframerate(), written.getsampwidth(), written.getnchannels()) == (24000, 2, 1)
    back = read_wav(tmp_path / "a.wav", sample_rate=24000)
    np.testing.assert_allclose(back[:-2], audio, atol=1 / 32767)
    assert back[-2] == pytest.approx(1.0, abs=1e-4) and back[-1] == pytest.approx(-1.0, abs=1e-4)  # clipped


def test_stereo_44k_input_becomes_16k_mono(tmp_path):
    t = np.arange(44100) / 44100
    left, right = 0.5 * np.sin(2 * np.pi * 440 * t), np.zeros_like(t)
    pcm = (np.stack([left, right], axis=1) * 32767).astype("<i2")
    with wave.open(str(tmp_path / "s.wav"), "wb") as out:
        out.setnchannels(2)
        out.setsampwidth(2)
        out.setframerate(44100)
        out.writeframes(pcm.tobytes())
    audio = read_wav(tmp_path / "s.wav")
    assert audio.dtype == np.float32 and audio.shape == (16000,)
    expected = 0.25 * np.sin(2 * np.pi * 440 * np.arange(16000) / 16000)
    np.testing.assert_allclose(audio, expected, atol=2e-3)


def test_resample_keeps_duration_and_identity():
    x = np.random.default_rng(0).standard_normal(480).astype(np.float32)
    assert np.array_equal(resample(x, 24000, 24000), x)
    assert resample(x, 24000, 16000).shape == (320,)


def test_request_tensors_have_the_contract_datatypes():
    inputs = {t.name(): t for t in build_inputs("héllo", np.zeros(1600), max_tokens=5, speaker="ethan",
                                                temperature=0.5, seed=7, return_audio=False, top_p=None)}
    datatypes = {name: tensor.datatype() for name, tensor in inputs.items()}
    assert datatypes == {"TEXT": "BYTES", "AUDIO_IN": "FP32", "MAX_TOKENS": "INT32", "SPEAKER": "BYTES",
                         "TEMPERATURE": "FP32", "SEED": "INT64", "RETURN_AUDIO": "BOOL"}
    assert all(tensor.shape() == [1] for name, tensor in inputs.items() if name != "AUDIO_IN")
    with pytest.raises(ValueError, match="unknown input 'speed'"):
        build_inputs("x", speed=2)


def test_rtf_is_wall_time_over_audio_duration():
    result = StreamResult(audio_chunks=[np.zeros(24000, np.float32), np.zeros(12000, np.float32)], total_s=0.75)
    assert result.audio_seconds == 1.5 and result.rtf == 0.5 and result.audio.shape == (36000,)
    assert StreamResult(total_s=1.0).rtf is None
