"""The talker stage's per-call host time in ``stage_io``: what one incoming talker request and one delivered
response cost in Python, on the CPU.

    python benchmarks/stage_io_bench.py --out-dir /tmp/stage_io_bench
    git worktree add /tmp/base main
    python benchmarks/stage_io_bench.py --baseline-tree /tmp/base   # base's stage_io and this one's, alternately

The real ``stage_io`` functions over a stand-in of ``triton_python_backend_utils`` (its Tensor: DLPack in and out,
``as_numpy`` for host inputs; ``get_input_tensor_by_name`` scanning ``request.inputs()`` as the real one does):

- ``request``: ``thinker_output_from_request`` of a talker append (START/END controls, ROW_IDS [1, rows], EMBEDS and
  HIDDEN [1, rows, 2048], PROMPT_LEN, THINKER_FINISHED), HIDDEN empty past the first chunk as served;
- ``response``: ``send_output`` of a ``TalkerOutput`` of CODES [frames, 16] int64 through ``talker_output_tensors``.

Per call, in microseconds of this thread's CPU time (``time.thread_time``: time spent waiting for a core on a
shared machine is not counted), the least over ``--repeat`` loops of ``--calls`` calls. On a GPU the request also
costs side-stream copies and a synchronize, the response torch's ``__dlpack__(stream)``: not seen here.

``--baseline-tree DIR`` loads that checkout's ``stage_io.py`` beside this one's in the same process (both over this
tree's package: handoff and the stage services are this tree's) and times them alternately, loop by loop: the
host of a small shared machine varies too much from one process to the next to compare separate runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
import time
from pathlib import Path
from typing import Callable

HIDDEN_SIZE, CODE_GROUPS = 2048, 16


class FakeTensor:
    """pb_utils.Tensor as a stage stub sees it: a name, a host buffer, DLPack out; ``from_dlpack`` keeps its input."""

    def __init__(self, name: str, value):
        self._name, self.value = name, value

    def name(self) -> str:
        return self._name

    def is_cpu(self) -> bool:
        return True

    def as_numpy(self):
        return self.value

    def to_dlpack(self):
        import torch.utils.dlpack
        return torch.utils.dlpack.to_dlpack(self.value)

    @classmethod
    def from_dlpack(cls, name: str, capsule):
        return cls(name, capsule)


class FakeRequest:
    def __init__(self, tensors: list[FakeTensor]):
        self._inputs = tensors

    def inputs(self) -> list[FakeTensor]:
        return list(self._inputs)  # the backend builds a new list per call


class FakeSender:
    def send(self, response=None, flags: int = 0) -> None:
        self.last = (response, flags)


def fake_pb():
    class TritonError:
        INTERNAL = 1

        def __init__(self, message: str, code: int = 1):
            self.message, self.code = message, code

    class InferenceResponse:
        def __init__(self, output_tensors=None, error=None):
            self.output_tensors, self.error = output_tensors, error

    def get_input_tensor_by_name(request, name):
        for tensor in request.inputs():
            if tensor.name() == name:
                return tensor
        return None

    return type("FakePbUtils", (), {
        "Tensor": FakeTensor, "TritonError": TritonError, "InferenceResponse": InferenceResponse,
        "TRITONSERVER_RESPONSE_COMPLETE_FINAL": 1, "get_input_tensor_by_name": staticmethod(get_input_tensor_by_name)})


def talker_append(rows: int, hidden_rows: int, dtype) -> FakeRequest:
    import numpy as np
    import torch
    return FakeRequest([
        FakeTensor("START", np.zeros((1, 1), dtype=np.int32)), FakeTensor("END", np.zeros((1, 1), dtype=np.int32)),
        FakeTensor("ROW_IDS", torch.arange(rows, dtype=torch.int64).reshape(1, rows)),
        FakeTensor("EMBEDS", torch.randn(1, rows, HIDDEN_SIZE).to(dtype)),
        FakeTensor("HIDDEN", torch.randn(1, hidden_rows, HIDDEN_SIZE).to(dtype)),
        FakeTensor("PROMPT_LEN", np.array([[hidden_rows]], dtype=np.int32)),
        FakeTensor("THINKER_FINISHED", np.array([[False]], dtype=bool))])


def load_stage_io(tree: Path):
    """``tree``'s ``omni_triton/stages/stage_io.py`` as a module of its own, over this tree's package (the modules it
    imports: handoff, the stage services), so that two versions of it run side by side in one process."""
    spec = importlib.util.spec_from_file_location(f"stage_io_of_{tree.name}", tree / "omni_triton/stages/stage_io.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cases(args) -> list[tuple[str, str, str, Callable]]:
    """(call, dtype, size, run(stage_io)) per case."""
    import torch

    from omni_triton.engine.handoff import InputStream
    from omni_triton.pipeline.talker_service import TalkerOutput

    pb, sender, inputs = fake_pb(), FakeSender(), InputStream(torch.device("cpu"))
    found = []
    for dtype_name in args.dtypes.split(","):
        for rows in map(int, args.rows.split(",")):
            for hidden_rows in (0, rows):
                request = talker_append(rows, hidden_rows, getattr(torch, dtype_name))
                found.append(("request", dtype_name, f"{rows} rows, {hidden_rows} hidden",
                              lambda io, request=request: io.thinker_output_from_request(pb, request, inputs)))
    for frames in map(int, args.frames.split(",")):
        out = TalkerOutput(torch.zeros(frames, CODE_GROUPS, dtype=torch.int64), finished=False)
        found.append(("response", "int64", f"{frames} frames",
                      lambda io, out=out: io.send_output(pb, sender, out, io.talker_output_tensors)))
    return found


def measure(versions: dict[str, object], args) -> list[dict]:
    """Per case, microseconds per call of each ``stage_io`` version: loops of ``--calls`` calls, the versions
    alternating loop by loop, the least loop of each over ``--repeat``."""
    import torch

    torch.set_num_threads(1)
    results = []
    for call, dtype, size, run in cases(args):
        best = dict.fromkeys(versions, float("inf"))
        for _ in range(args.repeat):
            for label, stage_io in versions.items():
                start = time.thread_time()
                for _ in range(args.calls):
                    run(stage_io)
                best[label] = min(best[label], time.thread_time() - start)
        results.append({"case": call, "dtype": dtype, "size": size,
                        **{label: seconds / args.calls * 1e6 for label, seconds in best.items()}})
    return results


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="4,100", help="comma-separated thinker rows per talker request")
    parser.add_argument("--dtypes", default="bfloat16,float32", help="EMBEDS/HIDDEN dtypes")
    parser.add_argument("--frames", default="1,4", help="comma-separated codec frames per talker response")
    parser.add_argument("--calls", type=int, default=200, help="calls per timed loop")
    parser.add_argument("--repeat", type=int, default=30, help="timed loops per case and version (least)")
    parser.add_argument("--baseline-tree", type=Path, default=None,
                        help="a checkout whose stage_io.py runs beside this one's, alternately")
    parser.add_argument("--out-dir", type=Path, default=None, help="where stage_io_bench.json goes")
    args = parser.parse_args(argv)
    this_tree = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(this_tree))
    versions = {"branch": load_stage_io(this_tree)}
    if args.baseline_tree is not None:
        versions = {"base": load_stage_io(args.baseline_tree.resolve()), **versions}
    results = measure(versions, args)
    print("stage_io host time per talker request / response (CPU, stand-in pb_utils), microseconds per call:")
    if args.baseline_tree is None:
        lines = ["| call | dtype | size | us/call |", "|---|---|---|---:|"]
        lines += [f"| {r['case']} | {r['dtype']} | {r['size']} | {r['branch']:.1f} |" for r in results]
    else:
        print(f"base {args.baseline_tree.resolve()} vs branch {this_tree}, alternating in one process")
        lines = ["| call | dtype | size | base us | branch us | branch/base |", "|---|---|---|---:|---:|---:|"]
        lines += [f"| {r['case']} | {r['dtype']} | {r['size']} | {r['base']:.1f} | {r['branch']:.1f} | "
                  f"{r['branch'] / r['base']:.2f} |" for r in results]
    print("\n".join(lines))
    if args.out_dir is not None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        report = {"machine": platform.processor() or platform.machine(), "python": platform.python_version(),
                  "calls": args.calls, "repeat": args.repeat, "tree": str(this_tree),
                  "baseline_tree": str(args.baseline_tree.resolve()) if args.baseline_tree else None,
                  "results": results}
        (args.out_dir / "stage_io_bench.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
