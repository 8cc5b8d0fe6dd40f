import threading, time, torch, torch.utils.dlpack as D, triton_python_backend_utils as pb
DEV = "cuda" if torch.cuda.is_available() else "cpu"
class TritonPythonModel:
    """X of length 1: send int(X[0]) responses (5 ms apart), then the final flag; else 3 responses."""
    def execute(self, requests):
        for r in requests:
            x = D.from_dlpack(pb.get_input_tensor_by_name(r, "X").to_dlpack()).to(DEV)
            n = int(x[0].item()) if x.numel() == 1 else 3
            s = r.get_response_sender()
            def run(x=x, s=s, n=n):
                for k in range(n):
                    y = (x * (k + 1)).contiguous()
                    s.send(pb.InferenceResponse([pb.Tensor.from_dlpack("Y", D.to_dlpack(y))]))
                    if n > 3: time.sleep(0.005)
                s.send(flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            threading.Thread(target=run).start()
        return None
