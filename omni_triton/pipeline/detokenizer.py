"""Incremental detokenization: token ids in, printable text deltas out.

Byte-level BPE tokens can split a UTF-8 character, so a delta is only released once it decodes
without a trailing replacement character. Decoding only a short window of recent tokens keeps each
step O(window) instead of re-decoding the whole output.
"""

from __future__ import annotations

from tokenizers import Tokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, skip_ids: set[int] | frozenset[int] = frozenset()):
        self._tokenizer = tokenizer
        self._skip_ids = skip_ids
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the window that gives decoding its context
        self._read_offset = 0  # tokens before this are already emitted
        # the prefix window's text, by (prefix_offset, read_offset): a push that releases nothing (a character
        # still split) leaves the window as it was, and the next push would decode the same ids again
        self._prefix_text: tuple[int, int, str] = (0, 0, "")

    def push(self, token_ids: list[int]) -> str:
        """Add tokens; return the text that became final (possibly empty)."""
        self._ids.extend(t for t in token_ids if t not in self._skip_ids)
        prefix = self._prefix()
        full = self._decode(self._ids[self._prefix_offset:])
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full[len(prefix):]

    def flush(self) -> str:
        """Whatever is left at the end of the stream, even an incomplete character."""
        prefix = self._prefix()
        full = self._decode(self._ids[self._prefix_offset:])
        self._prefix_offset = self._read_offset = len(self._ids)
        return full[len(prefix):]

    def _prefix(self) -> str:
        start, end, text = self._prefix_text
        if (start, end) != (self._prefix_offset, self._read_offset):
            text = self._decode(self._ids[self._prefix_offset:self._read_offset])
            self._prefix_text = (self._prefix_offset, self._read_offset, text)
        return text

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True) if ids else ""
