"""Which thinker prompt rows the talker reads, and how long its prefill is: from token ids alone, no torch.

Shared by the talker's input builder (``talker_inputs``) and by preprocess, which checks before any stage runs
that a request's audio fits the talker's KV cache and that its prompt has an assistant turn to speak.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

ASSISTANT_PREFILL_ROWS = 9


@dataclass(frozen=True)
class RoleTokenIds:
    """The chat-format ids the talker finds turns by (``OmniConfig`` has the same attributes)."""

    im_start_token_id: int
    user_token_id: int
    assistant_token_id: int

    @classmethod
    def from_config(cls, config: Mapping) -> "RoleTokenIds":
        """From a checkpoint's config.json dict."""
        return cls(int(config["im_start_token_id"]), int(config["user_token_id"]), int(config["assistant_token_id"]))


def user_row_mask(prompt_ids: Sequence[int], roles: RoleTokenIds) -> list[bool]:
    """Prompt rows that belong to a user turn: the token after the latest <|im_start|> at or before them is
    the user role token (rows before any <|im_start|> take the role at index 1, as HF does)."""
    mask, im_start = [], 0
    for position, token in enumerate(prompt_ids):
        if token == roles.im_start_token_id:
            im_start = position
        role_index = min(im_start + 1, len(prompt_ids) - 1)
        mask.append(prompt_ids[role_index] == roles.user_token_id)
    return mask


def assistant_start(prompt_ids: Sequence[int], roles: RoleTokenIds) -> int:
    """Index of the last ``<|im_start|>`` directly followed by the assistant role token."""
    for position in range(len(prompt_ids) - 2, -1, -1):
        if prompt_ids[position] == roles.im_start_token_id and prompt_ids[position + 1] == roles.assistant_token_id:
            return position
    raise ValueError("prompt has no '<|im_start|>assistant' turn for the talker to speak "
                     f"(im_start id {roles.im_start_token_id}, assistant id {roles.assistant_token_id})")


def talker_prefill_length(prompt_ids: Sequence[int], roles: RoleTokenIds) -> int:
    """Talker prefill positions for this prompt: its user rows + the assistant rows (raises like
    ``assistant_start`` when there is no assistant turn)."""
    assistant_start(prompt_ids, roles)
    return sum(user_row_mask(prompt_ids, roles)) + ASSISTANT_PREFILL_ROWS
