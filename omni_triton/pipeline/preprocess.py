"""The preprocess stage: validated request -> prompt token ids, log-mel features and sampling scalars."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

import numpy as np

from omni_triton.pipeline.chat import ChatTokenizer
from omni_triton.pipeline.request_params import (InvalidRequest, RequestLimits, RequestParams, SamplingDefaults,
                                                 check_context, parse_request)
from omni_triton.pipeline.talker_prompt import RoleTokenIds, talker_prefill_length

NUM_MEL_BINS = 128


class Preprocessor:
    def __init__(self, checkpoint_dir: str | Path, limits: RequestLimits, kv_cache_tokens: int,
                 talker_kv_cache_tokens: int | None = None):
        """``kv_cache_tokens``: what the thinker's KV cache holds, and the talker's unless
        ``talker_kv_cache_tokens`` says otherwise."""
        checkpoint_dir = Path(checkpoint_dir)
        config = json.loads((checkpoint_dir / "config.json").read_text())
        generation_path = checkpoint_dir / "generation_config.json"
        generation = json.loads(generation_path.read_text()) if generation_path.is_file() else {}
        thinker = config["thinker_config"]
        self.chat = ChatTokenizer.from_checkpoint(checkpoint_dir)
        self.limits = limits
        self.speakers = {name.lower(): int(i) for name, i in config["talker_config"]["speaker_id"].items()}
        self.defaults = SamplingDefaults.from_generation_config(generation)
        self.context_tokens = min(int(thinker["text_config"]["max_position_embeddings"]), kv_cache_tokens)
        self.talker_cache_tokens = talker_kv_cache_tokens or kv_cache_tokens
        self.roles = RoleTokenIds.from_config(config)
        self.audio_window = int(thinker["audio_config"].get("n_window", 50))
        self._log_mel = None  # built on the first spoken request: text-only serving never imports it

    def __call__(self, inputs: Mapping[str, np.ndarray | None]) -> dict[str, np.ndarray]:
        """Client tensors -> the preprocess outputs of the Triton contract (raises InvalidRequest)."""
        params = parse_request(inputs, self.limits, self.speakers, self.defaults)
        features, num_audio_tokens = self.audio_features(params.audio)
        input_ids = self.chat.encode_prompt(params.text, num_audio_tokens, params.history)
        check_context(len(input_ids), params.max_tokens, self.context_tokens,
                      "HISTORY" if params.history else "TEXT")
        if params.return_audio:
            self.check_talker_fits(input_ids, params.max_audio_frames)
        return {"INPUT_IDS": np.asarray(input_ids, dtype=np.int64), "AUDIO_FEATURES": features,
                **scalar_outputs(params)}

    def check_talker_fits(self, input_ids: list[int], max_audio_frames: int) -> None:
        """The talker can speak this prompt: it has an assistant turn, and its prefill plus MAX_AUDIO_FRAMES + 1
        tokens (at least one frame when 0) fit the talker's KV cache. Checked here, before any stage runs, so the
        request fails at once with INVALID_ARG instead of inside the talker."""
        try:
            prefill = talker_prefill_length(input_ids, self.roles)
        except ValueError as error:
            raise InvalidRequest("RETURN_AUDIO", f"cannot be true for this checkpoint's chat template: {error}; "
                                                 "ask for text only (RETURN_AUDIO=false)") from None
        most_frames = self.talker_cache_tokens - prefill - 1
        if max(max_audio_frames, 1) > most_frames:
            field = "MAX_AUDIO_FRAMES" if max_audio_frames else "TEXT"
            raise InvalidRequest(field, f"does not fit the talker: its KV cache holds {most_frames} audio frames "
                                        f"after this request's {prefill}-position talker prompt, and "
                                        f"MAX_AUDIO_FRAMES is {max_audio_frames or 'unbounded (0)'}")

    def audio_features(self, audio: np.ndarray | None) -> tuple[np.ndarray, int]:
        """16 kHz waveform -> (log-mel [128, frames], audio tokens the encoder will emit)."""
        if audio is None:
            return np.zeros((NUM_MEL_BINS, 0), dtype=np.float32), 0
        import torch

        from omni_triton.models.audio_encoder import num_audio_tokens
        from omni_triton.models.audio_features import LogMelExtractor

        if self._log_mel is None:
            self._log_mel = LogMelExtractor()
        features, lengths = self._log_mel(torch.tensor(audio))  # a copy: Triton input buffers are read-only
        frames = int(lengths[0])
        return features[0, :, :frames].numpy().astype(np.float32), int(num_audio_tokens(frames, self.audio_window))


def scalar_outputs(params: RequestParams) -> dict[str, np.ndarray]:
    return {
        "MAX_TOKENS": np.array([params.max_tokens], np.int32),
        "MIN_TOKENS": np.array([params.min_tokens], np.int32),
        "SPEAKER_ID": np.array([params.speaker_id], np.int64),
        "TEMPERATURE": np.array([params.temperature], np.float32),
        "TOP_P": np.array([params.top_p], np.float32),
        "TOP_K": np.array([params.top_k], np.int32),
        "REPETITION_PENALTY": np.array([params.repetition_penalty], np.float32),
        "TALKER_REPETITION_PENALTY": np.array([params.talker_repetition_penalty], np.float32),
        "SEED": np.array([params.seed], np.int64),
        "RETURN_AUDIO": np.array([params.return_audio], np.bool_),
        "IGNORE_EOS": np.array([params.ignore_eos], np.bool_),
        "MAX_AUDIO_FRAMES": np.array([params.max_audio_frames], np.int32),
        "MIN_AUDIO_FRAMES": np.array([params.min_audio_frames], np.int32),
        "SEQUENTIAL": np.array([params.sequential], np.bool_),
    }
