"""When the code2wav stage's ``execute`` hands control back to Triton: after its own decode, or the previous one's.

Triton's dynamic batcher gathers the next call's chunks while ``execute`` runs, so ``execute`` returns only once a
decode is done: returning at once left a chunk or two a call (2x the first chunk's time at 64 streams). By default
that is this call's decode: one call on the GPU at a time, and between two decodes the GPU waits for the host's
part of the next call (Triton's hand-off, parsing the requests, copying their codes, the launches): on an H200 at
64 streams the stage was in ``execute`` 86% of the wall and its GPU busy 75% (benchmarks/results/
h200-variants-ab36502). With ``overlap`` it returns once the *previous* call's decode is done: the next call's host
part runs while this call decodes, its launches queue behind it on the same stream (its state reads after this
call's state writes), and the chunks that arrive meanwhile still make up the call after it. The cost: a chunk may
wait for one more decode before its own.

Nothing else changes: the responses go out when their own decode is done (``deferred_sends`` waits on its event),
the codes a decode reads are the stage's own copies (``InputStream.owned_copies``), not Triton's request buffers.
"""

from __future__ import annotations

from typing import Protocol


class DecodeDone(Protocol):
    def synchronize(self) -> None: ...


class DecodePacing:
    def __init__(self, overlap: bool):
        self.overlap = overlap
        self._in_flight: DecodeDone | None = None  # with overlap: the decode that goes on after execute returned

    def before_return(self, decoded: DecodeDone | None) -> None:
        """At the end of ``execute``: wait for the decode that must be done before Triton gets control back.
        ``decoded``: this call's (its event; None on the CPU, where it is done already)."""
        if not self.overlap:
            if decoded is not None:
                decoded.synchronize()
            return
        previous, self._in_flight = self._in_flight, decoded
        if previous is not None:
            previous.synchronize()

    def drain(self) -> None:
        """Wait for the decode still going (the stage stops)."""
        previous, self._in_flight = self._in_flight, None
        if previous is not None:
            previous.synchronize()
