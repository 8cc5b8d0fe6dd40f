"""Does Python's garbage collector running inside a CUDA-graph capture break it? (GPU only; seconds.)

Question (issue 20, item 1): tests/test_completion_graphs.py passed alone but failed after the other GPU test
files, while capturing ("operation failed due to a previous error during capture", "operation not permitted
when stream is capturing"). Suspect: torch >= 2.9 does not collect garbage before a capture, so the collector
may run inside one and free an earlier engine's graphs, pinned buffers and events there.

The probe leaves a fast-path talker engine (tiny checkpoint) as a dead reference cycle, sets the collector to run
at almost every allocation, and builds a new engine (which captures its graphs), twice: capturing the way the
runner did before the fix (plain ``torch.cuda.graph``, global capture mode) and through
``omni_triton.graph_buckets.capturing`` (the fix). Prints one JSON line per way: did the capture fail, and how.

    python benchmarks/capture_gc_probe.py [--out FILE.json]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from omni_triton.checkpoints.tiny import build  # noqa: E402
from omni_triton.engine import EngineConfig, LLMEngine, TalkerStage  # noqa: E402
from omni_triton.engine import runner as runner_module  # noqa: E402
from omni_triton.graph_buckets import capturing  # noqa: E402
from omni_triton.models.weights import load_talker  # noqa: E402


@contextlib.contextmanager
def plain_capture(graph, pool=None, stream=None):
    with torch.cuda.graph(graph, pool=pool, stream=stream):  # the runner's capture before the fix
        yield


def engine_for(model) -> LLMEngine:
    zeros = torch.zeros(model.hidden_size, dtype=torch.float32, device="cuda")
    return LLMEngine(TalkerStage(model, tts_eos_embed=zeros, tts_pad_embed=zeros),
                     EngineConfig(block_size=16, num_blocks=64, max_num_seqs=8, max_num_batched_tokens=64,
                                  device=torch.device("cuda"), kv_dtype=torch.float32, fast_path=True))


def probe(model, way: str, capture) -> dict:
    runner_module.capturing = capture
    dead = engine_for(model)
    dead.runner.cycle = dead
    del dead
    thresholds = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        engine_for(model)
        outcome = {"way": way, "capture_failed": False}
    except RuntimeError as error:
        outcome = {"way": way, "capture_failed": True, "error": str(error).splitlines()[0][:300]}
    finally:
        gc.set_threshold(*thresholds)
        runner_module.capturing = capturing
    torch.cuda.synchronize()
    return outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    model = load_talker(build(Path(tempfile.mkdtemp()) / "tiny"), "cuda", torch.float32)
    # the fixed way first: a failed plain capture may leave the CUDA context unusable for what follows
    results = [probe(model, "capturing (gc kept out, thread_local)", capturing)]
    results.append(probe(model, "plain torch.cuda.graph (before the fix)", plain_capture))
    for result in results:
        print(json.dumps(result))
    if args.out:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                        "results": results}, indent=2))


if __name__ == "__main__":
    main()
