"""The checkpoint's chat template and tokenizer: user text (and spoken input) -> prompt token ids.

Renders tokenizer_config.json's jinja2 ``chat_template`` the way transformers' apply_chat_template does
(sandboxed, trim_blocks + lstrip_blocks), then tokenizes with tokenizer.json. Spoken input appears in the
template as one <|audio_pad|>, expanded here to one pad per audio-encoder output frame.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

AUDIO_PAD = "<|audio_pad|>"


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


class ChatTokenizer:
    def __init__(self, tokenizer: Tokenizer, chat_template: str, special_tokens: dict[str, str | None]):
        self.tokenizer = tokenizer
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.template = env.from_string(chat_template)
        self.special_tokens = special_tokens
        self.audio_pad_id = tokenizer.token_to_id(AUDIO_PAD)

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str | Path) -> "ChatTokenizer":
        checkpoint_dir = Path(checkpoint_dir)
        tokenizer = Tokenizer.from_file(str(checkpoint_dir / "tokenizer.json"))
        config = json.loads((checkpoint_dir / "tokenizer_config.json").read_text())
        template = config.get("chat_template")
        if template is None:  # newer checkpoints keep it in its own file
            template = (checkpoint_dir / "chat_template.jinja").read_text()
        special = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        return cls(tokenizer, template, special)

    @staticmethod
    def messages(text: str, with_audio: bool) -> list[dict]:
        content = [{"type": "audio", "audio": "<audio>"}] if with_audio else []
        if text:
            content.append({"type": "text", "text": text})
        return [{"role": "user", "content": content}]

    def render(self, text: str, with_audio: bool = False) -> str:
        return self.template.render(messages=self.messages(text, with_audio), add_generation_prompt=True,
                                    tools=None, documents=None, **self.special_tokens)

    def encode_prompt(self, text: str, num_audio_tokens: int = 0) -> list[int]:
        """Token ids of the user turn + the assistant prompt; ``num_audio_tokens`` pads for spoken input."""
        ids = self.tokenizer.encode(self.render(text, with_audio=num_audio_tokens > 0),
                                    add_special_tokens=False).ids
        if num_audio_tokens > 0:
            at = ids.index(self.audio_pad_id)
            ids[at:at + 1] = [self.audio_pad_id] * num_audio_tokens
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def _token_text(token) -> str | None:
    return token.get("content") if isinstance(token, dict) else token
