"""A session's conversation: its items in order (user text and audio, assistant replies, system messages) and
how they become the next turn's prompt.

The turn to answer is the trailing run of user items (their texts joined, their audio back to back, which the
model hears); every item before it goes in HISTORY as text, rendered with the turn by the checkpoint's chat
template (the preprocess stage; as transformers' processor renders the whole conversation). The thinker takes
one audio clip per request, so an earlier spoken user turn is in the history as its transcript when the item
has one, else as an empty user turn: the model answered it when it was the latest turn.
"""

from __future__ import annotations

import os

from dataclasses import dataclass, field

import numpy as np

from omni_triton.api.encoding import SAMPLES_PER_FRAME
from omni_triton.api.errors import ApiError, invalid
from omni_triton.client import OUTPUT_SAMPLE_RATE


@dataclass
class ConversationItem:
    id: str
    role: str  # system | user | assistant
    text: str = ""  # input_text / output_text, or the assistant audio's transcript
    audio: np.ndarray | None = None  # user audio at 16 kHz
    audio_transcript: str | None = None  # a user audio part's transcript, when the client gave one
    output_audio: bool = False  # an assistant item spoken (content output_audio) or written (output_text)
    audio_samples: int = 0  # assistant audio sent, 24 kHz samples
    status: str = "completed"

    def wire(self) -> dict:
        """The item as server events show it (audio itself is not echoed back)."""
        if self.role == "assistant":
            content = [{"type": "output_audio", "transcript": self.text} if self.output_audio
                       else {"type": "output_text", "text": self.text}]
        else:
            content = [{"type": "input_text", "text": self.text}] if self.text or self.audio is None else []
            if self.audio is not None:
                content.append({"type": "input_audio", "transcript": self.audio_transcript})
        return {"id": self.id, "object": "realtime.item", "type": "message", "status": self.status,
                "role": self.role, "content": content}

    def history_text(self) -> str:
        parts = [self.text] if self.text else []
        if self.audio_transcript:
            parts.append(self.audio_transcript)
        return "\n".join(parts)


@dataclass
class Turn:
    """What the next response answers: the prompt's last user turn and the messages before it."""

    text: str
    audio: np.ndarray | None
    history: list[dict]


@dataclass
class Conversation:
    max_items: int
    tokenizer: object = None  # the checkpoint's (tokenizers.Tokenizer), to cut transcripts at the audio heard
    items: list[ConversationItem] = field(default_factory=list)

    def add(self, item: ConversationItem, previous_item_id: str | None = None) -> str | None:
        """Insert after ``previous_item_id`` (absent: at the end); the id of the item before it."""
        if len(self.items) >= self.max_items:
            raise ApiError(400, f"conversation has {len(self.items)} items, the limit of this server: delete "
                                "items (conversation.item.delete) or start a new session", param="item",
                           code="conversation_too_long")
        if any(existing.id == item.id for existing in self.items):
            raise invalid("item.id", f"{item.id!r} is already in the conversation")
        at = len(self.items) if previous_item_id is None else self.index(previous_item_id, "previous_item_id") + 1
        self.items.insert(at, item)
        return self.items[at - 1].id if at else None

    def index(self, item_id: str, param: str = "item_id") -> int:
        for i, item in enumerate(self.items):
            if item.id == item_id:
                return i
        raise ApiError(400, f"{param} {item_id!r} is not in the conversation", param=param,
                       code="item_not_found")

    def get(self, item_id: str) -> ConversationItem:
        return self.items[self.index(item_id)]

    def delete(self, item_id: str) -> None:
        del self.items[self.index(item_id)]

    @property
    def last_id(self) -> str | None:
        return self.items[-1].id if self.items else None

    def truncate(self, item_id: str, content_index: int, audio_end_ms: int) -> None:
        """Cut an assistant item's audio at ``audio_end_ms`` (what the client played) and its transcript to the
        words spoken by then (``spoken_text``)."""
        item = self.get(item_id)
        if item.role != "assistant" or not item.output_audio:
            raise invalid("item_id", f"{item_id!r} is not an assistant item with audio: only those are truncated")
        if content_index != 0:
            raise invalid("content_index", f"must be 0 (an assistant item has one content part), got {content_index}")
        sent_ms = item.audio_samples * 1000 // OUTPUT_SAMPLE_RATE
        if audio_end_ms > sent_ms:
            raise invalid("audio_end_ms", f"is {audio_end_ms} ms, past the item's {sent_ms} ms of audio")
        self.cut_to_audio(item, audio_end_ms * OUTPUT_SAMPLE_RATE // 1000)

    def cut_to_audio(self, item: ConversationItem, heard_samples: int) -> None:
        """Keep what the item's first ``heard_samples`` of audio say (all the audio sent, after a cancel)."""
        item.text = spoken_text(item.text, heard_samples, item.audio_samples, self.tokenizer)
        item.audio_samples = heard_samples

    def turn(self, instructions: str) -> Turn:
        """The prompt of the next response (ApiError when there is no user turn to answer)."""
        start = len(self.items)
        while start and self.items[start - 1].role == "user":
            start -= 1
        current = self.items[start:]
        if not current:
            raise ApiError(400, "the conversation has no user turn to answer: add a user item (conversation.item."
                                "create or input_audio_buffer.commit) after the last response",
                           param="conversation", code="no_user_turn")
        audio = [item.audio for item in current if item.audio is not None]
        history = [{"role": "system", "content": instructions}] if instructions else []
        history += [{"role": item.role, "content": item.history_text()} for item in self.items[:start]]
        return Turn("\n".join(item.text for item in current if item.text), np.concatenate(audio) if audio else None,
                    history)


def spoken_text(transcript: str, heard_samples: int, sent_samples: int, tokenizer=None) -> str:
    """The part of a reply's transcript that its first ``heard_samples`` of audio speak. The talker speaks one
    text token per codec frame (its trailing text), so with the checkpoint's tokenizer: the first
    ceil(heard / 1920) tokens. Without it: the same share of the characters as of the audio sent, cut back to
    a whole word. Always a prefix of ``transcript``: a cut inside a character's bytes (byte-level tokens) keeps the
    text before that character, not a replacement character the transcript never had."""
    if tokenizer is not None:
        ids = tokenizer.encode(transcript, add_special_tokens=False).ids
        keep = -(-heard_samples // SAMPLES_PER_FRAME)
        if keep >= len(ids):
            return transcript
        return os.path.commonprefix([tokenizer.decode(ids[:keep]), transcript])
    if heard_samples >= sent_samples:
        return transcript
    keep = len(transcript) * heard_samples // sent_samples
    cut = transcript[:keep]
    if not transcript[keep].isspace():
        cut = cut[:cut.rfind(" ") + 1]
    return cut.rstrip()
