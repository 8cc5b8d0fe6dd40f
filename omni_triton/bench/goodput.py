"""Goodput (DESIGN.md section 6): the highest open-loop rate whose TTFA p95 is within a limit (500 ms) with no
stream running dry. A rate also fails when any request failed or was not sent: a server that refuses load or a
client that could not offer it has not served that rate.

Found over a list of rates (the highest that passes) or by a search: from a start rate, double while the rate
passes (halve while it fails), then bisect between the highest passing and the lowest failing rate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from omni_triton.bench.metrics import RAN_DRY_S
from omni_triton.bench.open_loop import RateSummary

TTFA_P95_LIMIT_S = 0.500


def verdict(row: RateSummary, ttfa_p95_limit_s: float = TTFA_P95_LIMIT_S) -> str | None:
    """None when ``row`` meets the goodput criterion, else every reason it does not, in one line."""
    reasons = []
    failed = sum(row.failed_by_code.values())
    if failed:
        reasons.append(f"{failed} failed")
    if row.not_started:
        reasons.append(f"{row.not_started} not sent (client in-flight cap)")
    if not row.completed:
        reasons.append("no request completed")
    ttfa_p95 = row.metrics.ttfa_p95
    if row.completed and ttfa_p95 is None:
        reasons.append("no audio")
    elif ttfa_p95 is not None and ttfa_p95 > ttfa_p95_limit_s:
        reasons.append(f"TTFA p95 {ttfa_p95 * 1000:.0f} ms > {ttfa_p95_limit_s * 1000:.0f} ms")
    if row.metrics.ran_dry:
        reasons.append(f"{row.metrics.ran_dry} ran dry (> {RAN_DRY_S * 1000:.0f} ms)")
    return "; ".join(reasons) or None


def highest_passing(results: dict[float, bool]) -> float | None:
    """The goodput of the rates tried: the highest that passed (None: none did)."""
    passed = [rate for rate, ok in results.items() if ok]
    return max(passed) if passed else None


@dataclass
class Search:
    """How the goodput search walks: ``start`` then doubling (or halving) until the verdict flips, at most up to
    ``max_rate`` and down to ``min_rate``; then ``bisections`` midpoints between the bracket's ends."""

    start: float = 1.0
    max_rate: float = 256.0
    min_rate: float = 0.125
    bisections: int = 3
    tried: dict[float, bool] = field(default_factory=dict)  # rate -> passed, in the order tried

    def __post_init__(self):
        if not 0 < self.min_rate <= self.start <= self.max_rate:
            raise ValueError(f"need 0 < min_rate <= start <= max_rate, got {self.min_rate}, {self.start}, "
                             f"{self.max_rate}")
        if self.bisections < 0:
            raise ValueError(f"bisections must be >= 0, got {self.bisections}")

    def run(self, passes: Callable[[float], bool]) -> float | None:
        """The goodput: measures rates through ``passes`` (rate -> met the criterion), each once."""

        def measure(rate: float) -> bool:
            rate = round(rate, 3)
            if rate not in self.tried:
                self.tried[rate] = passes(rate)
            return self.tried[rate]

        rate = self.start
        if measure(rate):
            while rate < self.max_rate and measure(min(rate * 2, self.max_rate)):
                rate = min(rate * 2, self.max_rate)
            low, high = rate, (min(rate * 2, self.max_rate) if rate < self.max_rate else None)
        else:
            while rate > self.min_rate and not measure(max(rate / 2, self.min_rate)):
                rate = max(rate / 2, self.min_rate)
            high = rate
            low = max(rate / 2, self.min_rate) if rate > self.min_rate else None
        if low is not None and high is not None:
            for _ in range(self.bisections):
                middle = (low + high) / 2
                if measure(middle):
                    low = middle
                else:
                    high = middle
        return highest_passing(self.tried)
