"""One Code2Wav interface over three backends: torch, ONNX Runtime, TensorRT.

    runtime = Code2WavRuntime.create("auto", checkpoint_dir, onnx_path=..., plan_path=..., device="cuda")
    waveform = runtime.decode(codes)  # codes int64 [B, G, N] -> float32 [B, N * samples_per_frame - trim]

``auto`` picks TensorRT when ``tensorrt`` imports, a plan file exists and the device is CUDA; else ONNX Runtime
when the .onnx file exists; else torch. The ONNX and TensorRT backends read only ``config.json`` from the
checkpoint (for shapes); the torch backend loads the ``code2wav.*`` weights. ONNX Runtime and TensorRT run on
the caller's torch tensors through their device pointers (IO binding / tensor addresses): no host copies
beyond what the execution provider itself needs.

``cuda_graphs=True`` (torch backend on a CUDA device; elsewhere, and for the other backends, it changes
nothing): short calls -- the first audio chunk and other calls of at most ``graph_settings.max_frames``
frames -- replay captured CUDA graphs instead of launching every kernel (``code2wav_graphs``); the first-chunk
shapes are captured when the runtime is built.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from omni_triton.models.code2wav import Code2Wav, Code2WavConfig
from omni_triton.models.code2wav_graphs import Code2WavGraphs, GraphSettings

KINDS = ("torch", "onnxruntime", "tensorrt", "auto")
INPUT_NAME, OUTPUT_NAME = "codes", "waveform"


class Code2WavRuntime:
    """Base: shapes from the config; subclasses implement ``_run``."""

    kind = "base"

    def __init__(self, config: Code2WavConfig, device: torch.device):
        self.config = config
        self.device = device
        self.num_quantizers = config.num_quantizers
        self.sliding_window = config.sliding_window
        self.samples_per_frame = Code2Wav.samples_per_frame_for(config)
        self.trim_samples = Code2Wav.trim_samples_for(config)

    def output_length(self, num_frames: int) -> int:
        return num_frames * self.samples_per_frame - self.trim_samples

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, G, N] integer ids -> waveform float32 [B, N * samples_per_frame - trim] on ``device``."""
        if codes.dim() != 3 or codes.shape[1] != self.num_quantizers or codes.shape[2] < 1:
            raise ValueError(f"codes must be [B, {self.num_quantizers}, N >= 1], got {tuple(codes.shape)}")
        return self._run(codes.to(self.device, torch.long).contiguous())

    def _run(self, codes: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @staticmethod
    def create(kind: str, checkpoint_dir: str | Path, *, onnx_path: str | Path | None = None,
               plan_path: str | Path | None = None, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32, load_format: str = "safetensors",
               seed: int = 0, cuda_graphs: bool = False,
               graph_settings: GraphSettings = GraphSettings()) -> "Code2WavRuntime":
        """``load_format``/``seed``: the torch backend's weights (``models.weights.load_code2wav``).
        ``cuda_graphs``/``graph_settings``: the torch backend's graph replay of short calls, on CUDA only (the
        TensorRT and ONNX Runtime backends ignore them)."""
        if kind not in KINDS:
            raise ValueError(f"Code2Wav runtime kind {kind!r} is not one of {KINDS}")
        device = torch.device(device)
        if kind == "auto":
            kind = _pick_auto(onnx_path, plan_path, device)
        config = Code2WavConfig.from_pretrained(checkpoint_dir)
        if kind == "torch":
            return TorchCode2Wav(checkpoint_dir, config, device, dtype, load_format, seed,
                                 cuda_graphs=cuda_graphs, graph_settings=graph_settings)
        if kind == "onnxruntime":
            return OnnxRuntimeCode2Wav(_existing(onnx_path, "onnx_path"), config, device)
        return TensorRTCode2Wav(_existing(plan_path, "plan_path"), config, device)


def _existing(path: str | Path | None, field: str) -> Path:
    if path is None or not Path(path).is_file():
        raise ValueError(f"{field}={path!r} is not an existing file")
    return Path(path)


def tensorrt_available() -> bool:
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return False
    return True


def _pick_auto(onnx_path, plan_path, device: torch.device) -> str:
    if device.type == "cuda" and plan_path is not None and Path(plan_path).is_file() and tensorrt_available():
        return "tensorrt"
    if onnx_path is not None and Path(onnx_path).is_file():
        return "onnxruntime"
    return "torch"


class TorchCode2Wav(Code2WavRuntime):
    kind = "torch"

    def __init__(self, checkpoint_dir, config: Code2WavConfig, device: torch.device, dtype: torch.dtype,
                 load_format: str = "safetensors", seed: int = 0, *, cuda_graphs: bool = False,
                 graph_settings: GraphSettings = GraphSettings()):
        super().__init__(config, device)
        from omni_triton.models.weights import load_code2wav

        self.model = load_code2wav(checkpoint_dir, device, dtype, load_format=load_format, seed=seed)
        # None: every call eager (CPU, or graphs off)
        self.graphs = (Code2WavGraphs(self._eager, self.num_quantizers, device, graph_settings)
                       if cuda_graphs and device.type == "cuda" else None)

    @torch.inference_mode()
    def _run(self, codes: torch.Tensor) -> torch.Tensor:
        if self.graphs is not None and self.graphs.serves(codes.shape):
            return self.graphs.run(codes)
        return self._eager(codes)

    @torch.inference_mode()
    def _eager(self, codes: torch.Tensor) -> torch.Tensor:
        return self.model(codes).float()


class OnnxRuntimeCode2Wav(Code2WavRuntime):
    """ONNX Runtime session; inputs and outputs bound to torch tensors (CUDA EP on a CUDA device)."""

    kind = "onnxruntime"

    def __init__(self, onnx_path: Path, config: Code2WavConfig, device: torch.device):
        super().__init__(config, device)
        import onnxruntime as ort

        options = ort.SessionOptions()
        if device.type == "cpu":
            options.intra_op_num_threads = torch.get_num_threads()
            providers = ["CPUExecutionProvider"]
        elif "CUDAExecutionProvider" in ort.get_available_providers():
            providers = [("CUDAExecutionProvider", {"device_id": device.index or 0})]
        else:
            raise ValueError(f"device={device} but this onnxruntime has no CUDAExecutionProvider "
                             f"(providers: {ort.get_available_providers()}); use device='cpu'")
        self.session = ort.InferenceSession(str(onnx_path), options, providers=providers)
        self._ort_device = ("cuda", device.index or 0) if device.type == "cuda" else ("cpu", 0)
        self._lock = threading.Lock()  # IO binding objects are not shared across threads

    def _run(self, codes: torch.Tensor) -> torch.Tensor:
        import numpy as np

        out = torch.empty(codes.shape[0], self.output_length(codes.shape[2]), dtype=torch.float32, device=self.device)
        device_type, device_id = self._ort_device
        with self._lock:
            binding = self.session.io_binding()
            binding.bind_input(INPUT_NAME, device_type, device_id, np.int64, tuple(codes.shape), codes.data_ptr())
            binding.bind_output(OUTPUT_NAME, device_type, device_id, np.float32, tuple(out.shape), out.data_ptr())
            if device_type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()  # codes written by torch's stream
            self.session.run_with_iobinding(binding)
        return out


class TensorRTCode2Wav(Code2WavRuntime):
    """A deserialized TensorRT plan with one execution context, run on torch's current CUDA stream."""

    kind = "tensorrt"

    def __init__(self, plan_path: Path, config: Code2WavConfig, device: torch.device):
        super().__init__(config, device)
        if device.type != "cuda":
            raise ValueError(f"the TensorRT backend needs a CUDA device, got device={device}")
        import tensorrt as trt

        self._trt = trt
        self._logger = trt.Logger(trt.Logger.WARNING)
        with torch.cuda.device(device):
            self.runtime = trt.Runtime(self._logger)
            self.engine = self.runtime.deserialize_cuda_engine(plan_path.read_bytes())
            if self.engine is None:
                raise ValueError(f"TensorRT could not deserialize {plan_path} (built by another TensorRT version "
                                 "or for another GPU?)")
            self.context = self.engine.create_execution_context()
        names = {self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)}
        if names != {INPUT_NAME, OUTPUT_NAME}:
            raise ValueError(f"{plan_path}: engine I/O tensors {sorted(names)} != {[INPUT_NAME, OUTPUT_NAME]}")
        self.input_dtype = _torch_dtype(trt, self.engine.get_tensor_dtype(INPUT_NAME))
        self.output_dtype = _torch_dtype(trt, self.engine.get_tensor_dtype(OUTPUT_NAME))
        self.min_shape, _, self.max_shape = (tuple(s) for s in self.engine.get_tensor_profile_shape(INPUT_NAME, 0))
        self._lock = threading.Lock()  # one execution context: one call at a time

    def _run(self, codes: torch.Tensor) -> torch.Tensor:
        shape = tuple(codes.shape)
        if any(n < lo or n > hi for n, lo, hi in zip(shape, self.min_shape, self.max_shape)):
            raise ValueError(f"codes shape {shape} is outside the engine profile {self.min_shape}..{self.max_shape}")
        codes = codes.to(self.input_dtype)
        out = torch.empty(shape[0], self.output_length(shape[2]), dtype=self.output_dtype, device=self.device)
        with self._lock:
            if not self.context.set_input_shape(INPUT_NAME, shape):
                raise ValueError(f"TensorRT rejected input shape {shape}")
            engine_out_shape = tuple(self.context.get_tensor_shape(OUTPUT_NAME))
            if engine_out_shape != tuple(out.shape):
                raise ValueError(f"engine output shape {engine_out_shape} != expected {tuple(out.shape)}")
            self.context.set_tensor_address(INPUT_NAME, codes.data_ptr())
            self.context.set_tensor_address(OUTPUT_NAME, out.data_ptr())
            stream = torch.cuda.current_stream(self.device)
            if not self.context.execute_async_v3(stream.cuda_stream):
                raise RuntimeError("TensorRT execute_async_v3 failed")
            # the context may be reused by the next call as soon as enqueue returns; `out` is ordered on
            # `stream`, so torch consumers on that stream need no sync
        return out.float()


def _torch_dtype(trt, trt_dtype) -> torch.dtype:
    names = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
             "int32": torch.int32, "int64": torch.int64}
    table = {getattr(trt, name): dtype for name, dtype in names.items() if hasattr(trt, name)}  # int64/bf16: TRT >= 9
    if trt_dtype not in table:
        raise ValueError(f"unsupported TensorRT tensor dtype {trt_dtype}")
    return table[trt_dtype]
