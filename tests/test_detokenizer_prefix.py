"""IncrementalDetokenizer keeps its prefix window's text: the deltas are those of decoding both windows afresh."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from omni_triton.pipeline.detokenizer import IncrementalDetokenizer


class ByteTokenizer:
    """Token id = one byte (ids 0-255, as byte-level BPE splits a character); counts its decodes."""

    def __init__(self):
        self.decodes = 0

    def decode(self, ids, skip_special_tokens=True):
        self.decodes += 1
        return bytes(ids).decode("utf-8", errors="replace")


class Uncached(IncrementalDetokenizer):
    def _prefix(self) -> str:
        return self._decode(self._ids[self._prefix_offset:self._read_offset])


@given(st.lists(st.text(max_size=3), max_size=20), st.lists(st.integers(1, 4), min_size=1, max_size=20))
@settings(max_examples=200, deadline=None)
def test_deltas_match_decoding_the_prefix_afresh(texts, cuts):
    ids = list("".join(texts).encode("utf-8"))
    kept, fresh = IncrementalDetokenizer(ByteTokenizer()), Uncached(ByteTokenizer())
    start, index = 0, 0
    while start < len(ids):
        end = start + cuts[index % len(cuts)]
        assert kept.push(ids[start:end]) == fresh.push(ids[start:end])
        start, index = end, index + 1
    assert kept.flush() == fresh.flush()


def test_a_push_that_releases_nothing_does_not_decode_the_prefix_again():
    tokenizer = ByteTokenizer()
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert detokenizer.push(list(b"ab")) == "ab"
    euro = list("€".encode("utf-8"))  # three bytes: nothing is released until the last
    assert detokenizer.push(euro[:1]) == ""
    decodes = tokenizer.decodes
    assert detokenizer.push(euro[1:2]) == ""
    assert tokenizer.decodes == decodes + 1  # the full window only: the prefix's text is kept
    assert detokenizer.push(euro[2:]) == "€"
