"""MODE: 0 plain BLS in execute; 1 decoupled BLS in execute; 2 decoupled BLS on a worker thread;
3 two concurrent decoupled streams + plain BLS fed a GPU tensor, on worker threads; 4 = 3 answering on host."""
import threading, torch, torch.utils.dlpack as D, triton_python_backend_utils as pb
DEV = "cuda" if torch.cuda.is_available() else "cpu"
def GPU(): return pb.PreferredMemory(pb.TRITONSERVER_MEMORY_GPU if torch.cuda.is_available() else pb.TRITONSERVER_MEMORY_CPU, 0)
def log(m): open("/tmp/bls_diag.txt", "a").write(m + "\n")
def T(t): return D.from_dlpack(t.to_dlpack())
class TritonPythonModel:
    def execute(self, requests):
        for r in requests:
            mode = int(pb.get_input_tensor_by_name(r, "MODE").as_numpy()[0])
            x = pb.get_input_tensor_by_name(r, "X")
            s = r.get_response_sender()
            if mode == 5:
                threading.Thread(target=self.stress, args=(s,)).start()
            elif mode in (2, 3, 4):
                threading.Thread(target=self.run, args=(mode, x, s)).start()
            else:
                self.run(mode, x, s)
        return None
    def reply(self, s, y, host):
        t = T(y)
        if host: t = t.cpu()
        log(f"reply: from is_cpu={y.is_cpu()} -> {t.device}")
        s.send(pb.InferenceResponse([pb.Tensor.from_dlpack("Y", D.to_dlpack(t.contiguous()))]))
    def stream(self, x, s, host, out):
        req = pb.InferenceRequest(model_name="callee_dec", inputs=[x], requested_output_names=["Y"], preferred_memory=GPU())
        for resp in req.exec(decoupled=True):
            if resp.has_error(): log("stream error " + resp.error().message()); continue
            ts = resp.output_tensors()
            if not ts: continue
            log(f"stream got Y is_cpu={ts[0].is_cpu()}")
            out.append(ts[0])
            if s is not None: self.reply(s, ts[0], host)
    def short(self, n_calls, errors):
        for i in range(n_calls):
            x = pb.Tensor.from_dlpack("X", D.to_dlpack(torch.tensor([float(i % 2)], device=DEV)))
            req = pb.InferenceRequest(model_name="callee_dec", inputs=[x], requested_output_names=["Y"], preferred_memory=GPU())
            for resp in req.exec(decoupled=True):
                if resp.has_error(): errors.append(resp.error().message())
    def stress(self, s):
        """mode 5: a long stream beside 4 threads of 150 short decoupled calls each (the talker-append pattern)."""
        errors = []
        try:
            long_x = pb.Tensor.from_dlpack("X", D.to_dlpack(torch.tensor([200.0], device=DEV)))
            got = []
            t_long = threading.Thread(target=self.stream, args=(long_x, None, False, got)); t_long.start()
            ts = [threading.Thread(target=self.short, args=(150, errors)) for _ in range(4)]
            [t.start() for t in ts]; [t.join() for t in ts]; t_long.join()
            self.reply(s, got[-1], False)
            log(f"mode 5 done: long stream {len(got)} responses, short errors {len(errors)}")
        except Exception as e:
            log(f"mode 5 exception {type(e).__name__}: {e}")
        s.send(flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
    def run(self, mode, x, s):
        try:
            host = mode == 4
            if mode == 0:
                resp = pb.InferenceRequest(model_name="callee_plain", inputs=[x], requested_output_names=["Y"], preferred_memory=GPU()).exec()
                self.reply(s, resp.output_tensors()[0], host)
            elif mode in (1, 2):
                self.stream(x, s, host, [])
            else:
                got = []
                other = threading.Thread(target=self.stream, args=(x, None, host, got)); other.start()
                mine = []
                self.stream(x, s, host, mine)
                other.join()
                y = pb.Tensor.from_dlpack("X", D.to_dlpack(T(mine[-1]).contiguous()))
                resp = pb.InferenceRequest(model_name="callee_plain", inputs=[y], requested_output_names=["Y"], preferred_memory=GPU()).exec()
                self.reply(s, resp.output_tensors()[0], host)
            log(f"mode {mode} done")
        except Exception as e:
            log(f"mode {mode} exception {type(e).__name__}: {e}")
        s.send(flags=pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
