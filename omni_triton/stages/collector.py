"""What a stage process's full garbage collections walk once it has loaded: only what serving allocated.

CPython's cyclic collector walks every tracked container of the generations it collects, and a full collection
walks all of them: a loaded stage's modules, parameters, CUDA graphs and their buckets, Triton's compiled-kernel
caches, none of which ever becomes garbage. The collection runs on whichever thread allocated past the threshold
and holds the GIL throughout, so every thread of the stub stops with it. On an H200 at full size the talker's
engine thread paused 150-212 ms in a full collection twice in 20 s of load, and the streams whose next frames were
due then ran dry (benchmarks/results/h200-code2wav-switches/talker-gc-pauses.md). ``gc.freeze()`` after
loading moves those objects into the permanent generation, which no collection walks; what serving allocates is
collected as before. A cycle among the frozen objects that became garbage later stays until the process ends: the
loaded objects live that long anyway. At exit they are unfrozen, so that the interpreter's last collections finalize
them.
"""

from __future__ import annotations

import atexit
import gc
import time

_unfreeze_at_exit = False  # registered once per process


def freeze_loaded_objects(stage: str) -> int:
    """Collect what loading left as garbage, then freeze every object still tracked; print how many (the stage's
    log) and return the count of frozen objects."""
    start = time.monotonic()
    gc.collect()  # what loading dropped goes now, not into the permanent generation
    gc.freeze()
    # back into the collector's reach when the process exits: its last collections finalize them (native bindings
    # such as Triton's nanobind report every object still alive then as a leak)
    global _unfreeze_at_exit
    if not _unfreeze_at_exit:
        atexit.register(gc.unfreeze)
        _unfreeze_at_exit = True
    frozen = gc.get_freeze_count()
    print(f"{stage}: {frozen} objects from loading kept out of garbage collection (gc.freeze, "
          f"{(time.monotonic() - start) * 1e3:.0f} ms)", flush=True)
    return frozen
