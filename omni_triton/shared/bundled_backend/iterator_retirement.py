"""Keep finished decoupled-BLS response iterators alive a while (Triton 2.51 stub: freed without the GIL).

A decoupled BLS call's iterator keeps every response it returned, and the stub's own table holds it too
until the stub's cleanup thread drops that reference, without taking the GIL (Triton 2.51). If Python let
go first, that thread destroys the responses and their numpy arrays: Python objects freed without the GIL,
which corrupted the orchestrator's heap (its stub died of a segfault after 10 to ~200 requests under 4
streams). The cleanup is queued when the last response arrives, so by the time a retired iterator is
dropped here, in a Python thread, ours is the last reference. Upstream fix: python_backend #433/#439
(r26.07: ~PbTensor takes the GIL).
"""

from __future__ import annotations

import collections
import os
import threading
import time
from typing import Any

# How long a finished iterator is kept; benchmarks/stub_workaround_soak.py measures what 0 (drop at once) does.
RETIREMENT_S = float(os.environ.get("OMNI_TRITON_BLS_ITERATOR_RETIREMENT_S", "2.0"))


class IteratorRetirement:
    def __init__(self):
        self._retired: collections.deque = collections.deque()
        self._lock = threading.Lock()

    def retire(self, iterator: Any) -> None:
        now = time.monotonic()
        expired = []
        with self._lock:
            self._retired.append((now + RETIREMENT_S, iterator))
            while self._retired and self._retired[0][0] <= now:
                expired.append(self._retired.popleft())
        del expired  # dropped outside the lock: destroying responses takes a moment

    def __len__(self) -> int:
        return len(self._retired)
