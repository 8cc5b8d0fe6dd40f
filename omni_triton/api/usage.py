"""Token counts for ``usage``, with the checkpoint's own tokenizer and chat template (``--checkpoint``).

Triton's stream carries text and audio, not token ids, so the API counts: the prompt exactly as the preprocess
stage builds it (chat template, one audio pad per audio-encoder output frame), the reply as its text's tokens,
and audio as codec frames. Without a checkpoint the text counts are unknown (null); audio frames are known.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from omni_triton.api.encoding import audio_frames


@dataclass
class Usage:
    prompt_tokens: int | None
    text_tokens: int | None
    audio_tokens: int

    @property
    def completion_tokens(self) -> int | None:
        return None if self.text_tokens is None else self.text_tokens + self.audio_tokens

    @property
    def total_tokens(self) -> int | None:
        completion = self.completion_tokens
        return None if completion is None or self.prompt_tokens is None else self.prompt_tokens + completion

    def chat(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.total_tokens,
                "completion_tokens_details": {"text_tokens": self.text_tokens, "audio_tokens": self.audio_tokens}}

    def realtime(self) -> dict:
        return {"input_tokens": self.prompt_tokens, "output_tokens": self.completion_tokens,
                "total_tokens": self.total_tokens,
                "output_token_details": {"text_tokens": self.text_tokens, "audio_tokens": self.audio_tokens}}

    def speech(self) -> dict:
        return {"input_tokens": self.prompt_tokens, "output_tokens": self.completion_tokens,
                "total_tokens": self.total_tokens}


class TokenCounter:
    def __init__(self, checkpoint_dir: str | Path | None):
        self.chat = None
        if checkpoint_dir is not None:
            from omni_triton.pipeline.chat import ChatTokenizer

            config = json.loads((Path(checkpoint_dir) / "config.json").read_text())
            self.audio_window = int(config["thinker_config"]["audio_config"].get("n_window", 50))
            self.chat = ChatTokenizer.from_checkpoint(checkpoint_dir)

    def usage(self, prompt_text: str, prompt_audio_samples: int, reply_text: str, reply_samples: int,
              history: list[dict] | None = None) -> Usage:
        frames = audio_frames(reply_samples)
        if self.chat is None:
            return Usage(None, None, frames)
        audio_tokens = 0
        if prompt_audio_samples:
            from omni_triton.models.audio_encoder import num_audio_tokens_for_samples

            audio_tokens = int(num_audio_tokens_for_samples(prompt_audio_samples, self.audio_window))
        prompt = len(self.chat.encode_prompt(prompt_text, audio_tokens, history or ()))
        reply = len(self.chat.tokenizer.encode(reply_text, add_special_tokens=False).ids) if reply_text else 0
        return Usage(prompt, reply, frames)
