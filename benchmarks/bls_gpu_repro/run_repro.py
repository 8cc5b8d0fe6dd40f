"""Which Python-backend BLS patterns carry GPU tensors on this tritonserver? (see README.md here)

One server per caller instance kind, restarted after a crash or a hang (a hung run leaves threads behind, so
later runs on that server would not be independent); each mode is one client stream to ``caller``. Prints
one dict per (kind, mode) run and a summary, and writes them to $OUT/bls_diag.json (OUT defaults to /tmp).
On a hang, every thread's stack of tritonserver and the stubs goes to $OUT/hang_<kind>_<n>.txt when cuda-gdb
(or gdb) is on PATH.

    MODES=0,1,2,3,4,5 MODE5_RUNS=20 python benchmarks/bls_gpu_repro/run_repro.py
    OMNI_TRITON_PYTHON_BACKEND=bundled ...      # the server install's own backend instead of the built one
"""
import collections
import json
import os
import queue
import shutil
import subprocess
from pathlib import Path

import numpy as np
import torch
import tritonclient.grpc as grpcclient

from omni_triton.launch.tritonserver import ServerOptions, TritonServer, find_tritonserver, free_port

HERE = Path(__file__).parent
OUT = Path(os.environ.get("OUT", "/tmp"))
TIMEOUT_S = float(os.environ.get("TIMEOUT_S", "60"))


def start(kind: str, tag: str) -> TritonServer:
    repo = Path(f"/tmp/bls_repo_{kind}")
    shutil.rmtree(repo, ignore_errors=True)
    shutil.copytree(HERE / "repo", repo)
    config = repo / "caller/config.pbtxt"
    config.write_text(config.read_text().replace("${KIND}", kind))
    if not torch.cuda.is_available():  # local dry run of this script
        for c in repo.glob("*/config.pbtxt"):
            c.write_text(c.read_text().replace("KIND_GPU", "KIND_CPU"))
    options = ServerOptions(gpu=torch.cuda.is_available(), grpc_port=free_port(), http_port=free_port(),
                            metrics_port=free_port(), log_verbose=int(os.environ.get("VERBOSE", "0")))
    install = find_tritonserver(device="cuda" if torch.cuda.is_available() else "cpu")
    server = TritonServer(repo, install, options, log_path=OUT / f"diag_{tag}.log")
    print(f"server {tag}: python backend {install.python_backend_note}", flush=True)
    server.start()
    server.wait_ready(timeout_s=180)
    return server


def one(server: TritonServer, mode: int) -> tuple[list, str | None]:
    responses = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    x = grpcclient.InferInput("X", [4], "FP32")
    x.set_data_from_numpy(np.arange(4, dtype=np.float32))
    m = grpcclient.InferInput("MODE", [1], "INT32")
    m.set_data_from_numpy(np.array([mode], np.int32))
    client.async_stream_infer("caller", [x, m], enable_empty_final_response=True)
    ys, error = [], None
    try:
        while True:
            result, failure = responses.get(timeout=TIMEOUT_S)
            if failure is not None:
                error = str(failure)
                break
            if result.get_response().outputs:
                ys.append(result.as_numpy("Y").tolist())
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
    except queue.Empty:
        error = "timeout"
    client.stop_stream(cancel_requests=True)
    client.close()
    return ys, error


def dump_stacks(server: TritonServer, path: Path) -> None:
    debugger = shutil.which("cuda-gdb") or shutil.which("gdb")
    if debugger is None:
        return
    pids = {"tritonserver": server.process.pid, **server.stub_pids()}
    with open(path, "w") as out:
        for name, pid in pids.items():
            out.write(f"===== {name} (pid {pid}) =====\n")
            out.flush()
            subprocess.run([debugger, "-p", str(pid), "-batch", "-ex", "thread apply all bt"], stdout=out,
                           stderr=subprocess.STDOUT, timeout=120)


def main() -> None:
    modes = [int(m) for m in os.environ.get("MODES", "0,1,2,3,4,5").split(",")]
    modes += [5] * (int(os.environ.get("MODE5_RUNS", "1")) - modes.count(5))
    results, hangs = [], 0
    for kind in os.environ.get("KINDS", "KIND_GPU,KIND_CPU").split(","):
        server = start(kind, kind)
        for run, mode in enumerate(modes):
            ys, error = one(server, mode)
            alive = server.process.poll() is None
            results.append(dict(kind=kind, mode=mode, outputs=ys if mode != 5 else len(ys), error=error,
                                server_alive=alive))
            print(results[-1], flush=True)
            if error == "timeout" and alive:
                hangs += 1
                dump_stacks(server, OUT / f"hang_{kind}_{hangs}.txt")
            if error is not None or not alive:
                server.stop()
                server = start(kind, f"{kind}_after{run}")
        server.stop()
    summary = collections.Counter((r["kind"], r["mode"], "ok" if r["error"] is None else r["error"][:40])
                                  for r in results)
    print("\nkind      mode  outcome  runs")
    for (kind, mode, outcome), count in sorted(summary.items()):
        print(f"{kind:9} {mode:4}  {outcome:8} {count}")
    (OUT / "bls_diag.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
