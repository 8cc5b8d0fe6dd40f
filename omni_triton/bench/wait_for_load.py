"""Wait until a server holds a load: ``python -m omni_triton.bench.wait_for_load METRICS_URL STREAMS [TIMEOUT_S]``.

A profile of a served level (benchmarks/pyspy_stages.sh) should record the level's steady state, not its ramp or
its tail: started at a fixed delay after the server is ready, an 8-s window at 64 streams on an H200 may have held
the level's end (benchmarks/results/h200-variants-ab36502). This waits until the orchestrator instances hold at
least STREAMS requests together (``omni_active_requests{stage="orchestrator"}``, summed), polling the metrics.
Exit 0 once they do, 1 at TIMEOUT_S (default 300) without, saying so (the caller records anyway, later than meant).
"""

from __future__ import annotations

import sys
import time

from omni_triton.bench.soak_probes import read_gauges

POLL_S = 0.2


def orchestrator_streams(gauges: dict[str, float]) -> float:
    """Requests the orchestrator instances hold, from ``read_gauges``' keys (``name{label=value,...}``)."""
    return sum(value for key, value in gauges.items()
               if key.startswith("omni_active_requests{") and "stage=orchestrator" in key.split("{", 1)[1])


def wait(metrics_url: str, streams: int, timeout_s: float, clock=time.monotonic, sleep=time.sleep) -> bool:
    deadline = clock() + timeout_s
    while True:
        try:
            if orchestrator_streams(read_gauges(metrics_url)) >= streams:
                return True
        except OSError:  # not serving metrics yet, or a scrape cut short: look again
            pass
        if clock() >= deadline:
            return False
        sleep(POLL_S)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (2, 3):
        print(__doc__.splitlines()[0], file=sys.stderr)
        return 2
    url, streams, timeout_s = args[0], int(args[1]), float(args[2]) if len(args) == 3 else 300.0
    if wait(url, streams, timeout_s):
        print(f"wait_for_load: {streams}+ requests held at {url}")
        return 0
    print(f"wait_for_load: fewer than {streams} requests held at {url} after {timeout_s:g} s", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
