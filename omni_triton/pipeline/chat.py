"""The checkpoint's chat template and tokenizer: user text (and spoken input) -> prompt token ids.

The ids are the ones transformers' Qwen3-Omni processor produces for the same turn
(``processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)``):

- the template is the one the processor loads (``chat_template_files``), rendered the way transformers
  renders it (sandboxed jinja2, trim_blocks + lstrip_blocks, its ``tojson``, the tokenizer's named special
  tokens as variables);
- the user turn is built the way a caller of that processor must write it for this template. A template that
  reads content parts (Qwen3-Omni's: ``{% for part in message['content'] %}``) gets parts: an audio part, then
  a text part. A template that prints ``message['content']`` as it is (plain ChatML) gets the text as a string:
  given parts it would print their Python repr. Such a template has no place for audio, and the processor
  refuses audio with it, so spoken input is refused too;
- the prompt is tokenized as the processor does: special tokens are added (the tokenizer's post-processor)
  unless the prompt already starts with the BOS token, and the one audio pad the template renders is expanded
  to one pad per audio-encoder output frame.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Sequence

import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from omni_triton.pipeline.request_params import InvalidRequest

# The tokenizer attributes transformers passes to every chat template (``special_tokens_map``).
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# What a template sees of a waveform in an audio part: transformers replaces every non-JSON value with its type.
AUDIO_PART = {"type": "audio", "audio": "<ndarray>"}
_PROBE_TEXT = "omni-triton content probe"


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' filter: jinja's own escapes HTML characters, which a prompt must not
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class ChatTokenizer:
    def __init__(self, tokenizer: Tokenizer, chat_template: str, special_tokens: dict[str, str],
                 audio_token_id: int):
        self.tokenizer = tokenizer
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.template = env.from_string(chat_template)
        self.special_tokens = special_tokens  # only the ones the tokenizer has: a missing one is undefined
        self.audio_token_id = audio_token_id
        self.audio_token = tokenizer.id_to_token(audio_token_id)
        self.content_is_string = self._prints_content_as_is()

    @classmethod
    def from_checkpoint(cls, checkpoint_dir: str | Path) -> "ChatTokenizer":
        checkpoint_dir = Path(checkpoint_dir)
        tokenizer = Tokenizer.from_file(str(checkpoint_dir / "tokenizer.json"))
        config = json.loads((checkpoint_dir / "config.json").read_text())
        return cls(tokenizer, chat_template(checkpoint_dir), special_tokens(checkpoint_dir),
                   int(config["thinker_config"]["audio_token_id"]))

    def messages(self, text: str, with_audio: bool, history: Sequence[dict] = ()) -> list[dict]:
        """The earlier turns (``{"role", "content": text}``, oldest first) and the user turn, as transformers'
        processor takes a conversation for this template (see the module doc)."""
        if self.content_is_string:
            if with_audio:
                raise InvalidRequest("AUDIO_IN", "cannot be used with this checkpoint: its chat template prints a "
                                                 "message's content as one string, so it has no place for spoken "
                                                 "input (transformers' processor refuses audio with it too)")
            return [*(dict(message) for message in history), {"role": "user", "content": text}]
        content = [dict(AUDIO_PART)] if with_audio else []
        if text:
            content.append({"type": "text", "text": text})
        earlier = [{"role": message["role"],
                    "content": [{"type": "text", "text": message["content"]}] if message["content"] else []}
                   for message in history]
        return [*earlier, {"role": "user", "content": content}]

    def render(self, text: str, with_audio: bool = False) -> str:
        return self._render(self.messages(text, with_audio))

    def encode_prompt(self, text: str, num_audio_tokens: int = 0, history: Sequence[dict] = ()) -> list[int]:
        """Token ids of the earlier turns, the user turn and the assistant prompt; ``num_audio_tokens`` pads for
        spoken input (of this turn: the thinker takes one audio clip per request)."""
        return self.encode_messages(self.messages(text, num_audio_tokens > 0, history), num_audio_tokens)

    def encode_messages(self, messages: list[dict], num_audio_tokens: int = 0) -> list[int]:
        """Token ids of a conversation (transformers' message dicts: earlier turns, then the user's) + the
        assistant prompt; the one audio part's pad expanded to ``num_audio_tokens`` pads."""
        prompt = self._render(messages)
        bos = self.special_tokens.get("bos_token")
        ids = self.tokenizer.encode(prompt, add_special_tokens=not (bos and prompt.startswith(bos))).ids
        if num_audio_tokens > 0:
            pads = ids.count(self.audio_token_id)
            if pads != 1:
                raise InvalidRequest("AUDIO_IN", f"cannot be used with this checkpoint: its chat template renders "
                                                 f"{pads} {self.audio_token} tokens for one audio part "
                                                 "(transformers' processor refuses such a prompt too)")
            at = ids.index(self.audio_token_id)
            ids[at:at + 1] = [self.audio_token_id] * num_audio_tokens
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _render(self, messages: list[dict]) -> str:
        return self.template.render(messages=messages, add_generation_prompt=True, tools=None, documents=None,
                                    **self.special_tokens)

    def _prints_content_as_is(self) -> bool:
        """Whether the template prints ``message['content']`` itself (ChatML) rather than reading its parts: given
        parts, such a template writes their repr (or JSON) into the prompt."""
        parts = [{"type": "text", "text": _PROBE_TEXT}]
        prompt = self._render([{"role": "user", "content": parts}])
        return str(parts) in prompt or _tojson(parts) in prompt


def chat_template(checkpoint_dir: Path) -> str:
    """The template transformers' processor loads: chat_template.json (its legacy file), chat_template.jinja,
    processor_config.json; else the tokenizer's own (tokenizer_config.json), for checkpoints without processor
    files."""
    legacy = checkpoint_dir / "chat_template.json"
    if legacy.is_file():
        return json.loads(legacy.read_text())["chat_template"]
    raw = checkpoint_dir / "chat_template.jinja"
    if raw.is_file():
        return raw.read_text()
    for name in ("processor_config.json", "tokenizer_config.json"):
        path = checkpoint_dir / name
        template = json.loads(path.read_text()).get("chat_template") if path.is_file() else None
        if isinstance(template, list):  # named templates: transformers uses the one called "default"
            template = {entry["name"]: entry["template"] for entry in template}.get("default")
        if template:
            return template
    raise FileNotFoundError(f"{checkpoint_dir} has no chat template (chat_template.jinja, chat_template.json, "
                            "processor_config.json or tokenizer_config.json)")


def special_tokens(checkpoint_dir: Path) -> dict[str, str]:
    """The tokenizer's named special tokens (special_tokens_map.json, then tokenizer_config.json), as text."""
    found = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
        path = checkpoint_dir / name
        config = json.loads(path.read_text()) if path.is_file() else {}
        for key in NAMED_SPECIAL_TOKENS:
            token = config.get(key)
            token = token.get("content") if isinstance(token, dict) else token
            if token is not None:
                found[key] = token
    return found
