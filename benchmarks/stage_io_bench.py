"""The talker stage's per-call host time in ``stage_io``: what one incoming talker request and one delivered
response cost in Python, on the CPU.

    python benchmarks/stage_io_bench.py --out-dir /tmp/stage_io_bench
    git worktree add /tmp/base main
    python benchmarks/stage_io_bench.py --baseline-tree /tmp/base --rounds 3   # base and this tree, alternately

The real ``stage_io`` functions over a stand-in of ``triton_python_backend_utils`` (its Tensor: DLPack in and out,
``as_numpy`` for host inputs; ``get_input_tensor_by_name`` scanning ``request.inputs()`` as the real one does):

- ``request``: ``thinker_output_from_request`` of a talker append (START/END controls, ROW_IDS [1, rows], EMBEDS and
  HIDDEN [1, rows, 2048], PROMPT_LEN, THINKER_FINISHED), HIDDEN empty past the first chunk as served;
- ``response``: ``send_output`` of a ``TalkerOutput`` of CODES [frames, 16] int64 through ``talker_output_tensors``.

Per call, in microseconds of this thread's CPU time (``time.thread_time``: time spent waiting for a core on a
shared machine is not counted), the least over ``--repeat`` loops of ``--calls`` calls. On a GPU the request also
costs side-stream copies and a synchronize, the response torch's ``__dlpack__(stream)``: not seen here.

``--baseline-tree DIR`` runs the same cases over that checkout's ``omni_triton`` and this one's, alternating process
by process (``--rounds`` each), and prints base, branch and branch/base per case (medians over the processes).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HIDDEN_SIZE, CODE_GROUPS = 2048, 16


class FakeTensor:
    """pb_utils.Tensor as a stage stub sees it: a name, a host buffer, DLPack out; ``from_dlpack`` keeps what it gets."""

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


def per_call_us(call, calls: int, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.thread_time()
        for _ in range(calls):
            call()
        best = min(best, time.thread_time() - start)
    return best / calls * 1e6


def worker(args) -> dict:
    import torch

    import omni_triton
    from omni_triton.engine.handoff import InputStream
    from omni_triton.pipeline.talker_service import TalkerOutput
    from omni_triton.stages import stage_io

    torch.set_num_threads(1)
    pb, sender, inputs = fake_pb(), FakeSender(), InputStream(torch.device("cpu"))
    results = []
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for rows in map(int, args.rows.split(",")):
            for hidden_rows in (0, rows):
                request = talker_append(rows, hidden_rows, dtype)
                us = per_call_us(lambda: stage_io.thinker_output_from_request(pb, request, inputs),
                                 args.calls, args.repeat)
                results.append({"case": "request", "dtype": dtype_name, "size": f"{rows} rows, {hidden_rows} hidden",
                                "us": us})
    for frames in map(int, args.frames.split(",")):
        out = TalkerOutput(torch.zeros(frames, CODE_GROUPS, dtype=torch.int64), finished=False)
        us = per_call_us(lambda: stage_io.send_output(pb, sender, out, stage_io.talker_output_tensors),
                         args.calls, args.repeat)
        results.append({"case": "response", "dtype": "int64", "size": f"{frames} frames", "us": us})
    return {"tree": str(Path(omni_triton.__file__).resolve().parents[1]), "results": results}


def table(results: list[dict]) -> list[str]:
    lines = ["| call | dtype | size | us/call |", "|---|---|---|---:|"]
    lines += [f"| {r['case']} | {r['dtype']} | {r['size']} | {r['us']:.1f} |" for r in results]
    return lines


def compare_table(base: list[dict], branch: list[dict]) -> list[str]:
    lines = ["| call | dtype | size | base us | branch us | branch/base |", "|---|---|---|---:|---:|---:|"]
    lines += [f"| {r['case']} | {r['dtype']} | {r['size']} | {b['us']:.1f} | {r['us']:.1f} | {r['us'] / b['us']:.2f} |"
              for b, r in zip(base, branch)]
    return lines


def run_tree(tree: Path, args) -> dict:
    """This script's ``--worker`` in a process of its own over ``tree``'s omni_triton, and the JSON it prints last."""
    command = [sys.executable, "-P", str(Path(__file__).resolve()), "--worker", "--rows", args.rows, "--dtypes",
               args.dtypes, "--frames", args.frames, "--calls", str(args.calls), "--repeat", str(args.repeat)]
    done = subprocess.run(command, env={**os.environ, "PYTHONPATH": str(tree)}, check=True, stdout=subprocess.PIPE,
                          text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def median_results(runs: list[dict]) -> list[dict]:
    return [{**cells[0], "us": statistics.median(c["us"] for c in cells)} for cells in zip(*(r["results"] for r in runs))]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="4,100", help="comma-separated thinker rows per talker request")
    parser.add_argument("--dtypes", default="bfloat16,float32", help="EMBEDS/HIDDEN dtypes")
    parser.add_argument("--frames", default="1,4", help="comma-separated codec frames per talker response")
    parser.add_argument("--calls", type=int, default=2000, help="calls per timed loop")
    parser.add_argument("--repeat", type=int, default=7, help="timed loops per case (least)")
    parser.add_argument("--baseline-tree", type=Path, default=None, help="a checkout to compare with, alternately")
    parser.add_argument("--rounds", type=int, default=3, help="with --baseline-tree: processes per tree")
    parser.add_argument("--out-dir", type=Path, default=None, help="where stage_io_bench.json goes")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return
    this_tree = Path(__file__).resolve().parents[1]
    report = {"machine": platform.processor() or platform.machine(), "python": platform.python_version(),
              "calls": args.calls, "repeat": args.repeat}
    print("stage_io host time per talker request / response (CPU, stand-in pb_utils), microseconds:")
    if args.baseline_tree is None:
        run = run_tree(this_tree, args)
        report.update(tree=run["tree"], results=run["results"])
        print(f"tree {run['tree']}")
        print("\n".join(table(run["results"])))
    else:
        base_runs, branch_runs = [], []
        for _ in range(args.rounds):
            base_runs.append(run_tree(args.baseline_tree.resolve(), args))
            branch_runs.append(run_tree(this_tree, args))
        base, branch = median_results(base_runs), median_results(branch_runs)
        report.update(base_tree=base_runs[0]["tree"], branch_tree=branch_runs[0]["tree"], rounds=args.rounds,
                      base=base, branch=branch, base_runs=base_runs, branch_runs=branch_runs)
        print(f"base {base_runs[0]['tree']} vs branch {branch_runs[0]['tree']}, medians of {args.rounds} processes "
              "each, alternating")
        print("\n".join(compare_table(base, branch)))
    if args.out_dir is not None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / "stage_io_bench.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
