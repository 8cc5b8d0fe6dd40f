"""When a request's step outputs go to its consumer: every step, or a few steps' worth at a time.

A served stage sends one Triton response per delivered output, and each response costs the stage's response
thread and, above all, the orchestrator (one Python process with the GIL for every stream: it receives the response,
appends its frames, forwards them) a fixed amount of host work. At 64 streams a response per step per stream was
thousands a second: once the stages stopped waiting for their queued steps on every send, the orchestrator's Python
became the bound (its own hops grew tenfold and streams ran dry). Delivering a few steps at once costs a little
latency where nothing needs it sooner -- the first audio chunk needs ``first_chunk_frames`` frames anyway, and the
talker consumes the thinker's text one token a frame, slower than the thinker makes it.

``OutputBatching`` says when an output is due; ``HeldOutputs`` keeps the ones that are not, per request. Each round
the engine's response thread gathers what it holds with what the steps produced (``engine.gather_outputs``: a
request's parts, merged only when delivered) and delivers what is due. An output is due when its request finished, or
- until its first ``first_tokens`` tokens were delivered: once they are all there, however long that takes (the
  consumer cannot use fewer: the talker's first response carries the first audio chunk's frames; delivered in part
  once the hold ran out, the rest waited for ``min_tokens`` or another hold, 40 ms at the defaults, and the first
  audio with it);
- while fewer than ``eager_tokens`` tokens were delivered: at once (a consumer starting up);
- after that: once it has ``min_tokens`` tokens;
and, after the first tokens, always once its oldest part waited ``max_hold_s`` (a slow request never waits on its
own batch). The default delivers everything at once, as before batching existed.

A round's due outputs go out starting streams first: those carrying a request's first tokens, then the rest, each
group in its order. A round's deliveries take the response thread a while (each is a Triton response: export,
send), and a stream waiting for its first audio has nothing buffered, while the others' listeners play what they
got. Pure logic: times come in as arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class OutputBatching:
    first_tokens: int = 1
    eager_tokens: int = 0
    min_tokens: int = 1
    max_hold_s: float = 0.0

    def __post_init__(self):
        if self.first_tokens < 1 or self.min_tokens < 1 or self.eager_tokens < 0 or self.max_hold_s < 0:
            raise ValueError(f"OutputBatching: first_tokens and min_tokens must be >= 1, eager_tokens and max_hold_s "
                             f">= 0, got {self}")

    @property
    def holds(self) -> bool:
        return self.max_hold_s > 0 and (self.first_tokens > 1 or self.min_tokens > 1)


class HeldOutputs:
    """Outputs not due yet, one per request, with when their oldest part arrived and how many tokens each request
    has had delivered."""

    def __init__(self, policy: OutputBatching):
        self.policy = policy
        self._held: dict[str, Any] = {}  # request id -> its merged output not delivered yet
        self._since: dict[str, float] = {}  # request id -> when its held output's oldest part arrived
        self._delivered: dict[str, int] = {}  # request id -> tokens delivered so far

    def __len__(self) -> int:
        return len(self._held)

    def take_held(self) -> list[Any]:
        """The held outputs, to be merged in front of this round's (their arrival times are kept)."""
        held, self._held = list(self._held.values()), {}
        return held

    def due(self, merged: list[Any], now: float) -> list[Any]:
        """Of ``merged`` (this round's outputs, one per request, each merged with its held one), those due now:
        the ones with a request's first tokens first, then the others, each in their order (module doc); the
        others are held."""
        if not self.policy.holds:  # nothing is ever held: no bookkeeping on the response thread
            return merged
        starting, playing = [], []
        for output in merged:
            request_id = output.request_id
            since = self._since.setdefault(request_id, now)
            if self._is_due(output, since, now):
                (playing if request_id in self._delivered else starting).append(output)
                self._since.pop(request_id, None)
                if output.finished:
                    self._delivered.pop(request_id, None)
                else:
                    self._delivered[request_id] = self._delivered.get(request_id, 0) + len(output.new_token_ids)
            else:
                self._held[request_id] = output
        return starting + playing

    def wait_s(self, now: float) -> float | None:
        """Seconds until the oldest held output is due by age (None: none can be). An output still short of its
        first tokens is never due by age: only more tokens make it due, and they come with a new round."""
        aging = [self._since[request_id] for request_id in self._held
                 if self._delivered.get(request_id, 0) >= self.policy.first_tokens]
        if not aging:
            return None
        return max(0.0, min(aging) + self.policy.max_hold_s - now)

    def _is_due(self, output: Any, since: float, now: float) -> bool:
        policy = self.policy
        tokens = len(output.new_token_ids)
        delivered = self._delivered.get(output.request_id, 0)
        if output.finished:
            return True
        if delivered < policy.first_tokens:  # the first tokens go whole (module doc), the hold aside
            return delivered + tokens >= policy.first_tokens
        if now - since >= policy.max_hold_s:
            return True
        if delivered < policy.eager_tokens:
            return tokens > 0
        return tokens >= policy.min_tokens
