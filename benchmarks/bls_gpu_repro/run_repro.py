"""Which Python-backend BLS patterns carry GPU tensors on this tritonserver? (see README.md here)

One server per caller instance kind, restarted after a crash; each mode is one client stream to ``caller``.
Prints one dict per (kind, mode) and writes them to $OUT/bls_diag.json (OUT defaults to /tmp).

    MODES=0,1,2,3,4,5 python benchmarks/bls_gpu_repro/run_repro.py
"""
import json, os, queue, shutil
from pathlib import Path
import numpy as np, tritonclient.grpc as g
from omni_triton.server.tritonserver import TritonServer, ServerOptions, find_tritonserver, free_port
here = Path(__file__).parent; out = Path(os.environ.get("OUT", "/tmp")); results = []
def start(kind, tag):
    repo = Path(f"/tmp/bls_repo_{kind}"); shutil.rmtree(repo, ignore_errors=True); shutil.copytree(here / "repo", repo)
    cfg = repo / "caller/config.pbtxt"; cfg.write_text(cfg.read_text().replace("${KIND}", kind))
    if not __import__("torch").cuda.is_available():  # local dry run of this script
        for c in repo.glob("*/config.pbtxt"): c.write_text(c.read_text().replace("KIND_GPU", "KIND_CPU"))
    opts = ServerOptions(gpu=__import__("torch").cuda.is_available(), grpc_port=free_port(), http_port=free_port(), metrics_port=free_port(),
                         log_verbose=int(os.environ.get("VERBOSE", "0")))
    srv = TritonServer(repo, find_tritonserver(), opts, log_path=out / f"diag_{tag}.log"); srv.start(); srv.wait_ready(timeout_s=180)
    return srv
def one(srv, mode):
    q = queue.Queue(); c = g.InferenceServerClient(srv.grpc_url)
    c.start_stream(callback=lambda result, error: q.put((result, error)))
    x = g.InferInput("X", [4], "FP32"); x.set_data_from_numpy(np.arange(4, dtype=np.float32))
    m = g.InferInput("MODE", [1], "INT32"); m.set_data_from_numpy(np.array([mode], np.int32))
    c.async_stream_infer("caller", [x, m], enable_empty_final_response=True)
    ys, err = [], None
    try:
        while True:
            r, e = q.get(timeout=60)
            if e is not None: err = str(e); break
            if r.get_response().outputs: ys.append(r.as_numpy("Y").tolist())
            if r.get_response().parameters["triton_final_response"].bool_param: break
    except queue.Empty:
        err = "timeout"
    c.stop_stream(cancel_requests=True); c.close()
    return ys, err
for kind in ("KIND_GPU", "KIND_CPU"):
    srv = start(kind, kind)
    for mode in [int(m) for m in os.environ.get('MODES', '0,1,2,3,4,5,5,5').split(',')]:
        ys, err = one(srv, mode)
        alive = srv.process.poll() is None
        results.append(dict(kind=kind, mode=mode, outputs=ys, error=err, server_alive=alive))
        print(results[-1], flush=True)
        if not alive:
            srv.stop(); srv = start(kind, f"{kind}_after{mode}")
    srv.stop()
(out / "bls_diag.json").write_text(json.dumps(results, indent=1))
if os.path.exists("/tmp/bls_diag.txt"): shutil.copy("/tmp/bls_diag.txt", out / "bls_diag_trace.txt")
