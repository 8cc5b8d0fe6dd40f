"""One Code2Wav interface over three backends: torch, ONNX Runtime, TensorRT.

    runtime = Code2WavRuntime.create("auto", checkpoint_dir, onnx_path=..., plan_path=..., device="cuda")
    waveform = runtime.decode(codes)  # codes int64 [B, G, N] -> float32 [B, N * samples_per_frame - trim]

``auto`` picks TensorRT when ``tensorrt`` imports, a plan file exists and the device is CUDA; else ONNX Runtime
when the .onnx file exists; else torch. The ONNX and TensorRT backends read only ``config.json`` from the
checkpoint (for shapes); the torch backend loads the ``code2wav.*`` weights. ONNX Runtime and TensorRT run on
the caller's torch tensors through their device pointers (IO binding / tensor addresses): no host copies
beyond what the execution provider itself needs.

Streaming with carried state (``code2wav_streaming``): ``decode_stream(codes, lengths, state)`` decodes only
new frames, each row's state in and out (``state_specs`` layout). The torch backend always can; ONNX Runtime
when its file is a ``--stateful`` export (``streams`` says which); the TensorRT backend cannot (yet).

``cuda_graphs=True`` (torch backend on a CUDA device; elsewhere, and for the other backends, it changes
nothing): short calls -- the first audio chunk and other calls of at most ``graph_settings.max_frames``
frames -- replay captured CUDA graphs instead of launching every kernel (``code2wav_graphs``); the first-chunk
shapes are captured when the runtime is built. ``decode_stream`` calls of such shapes replay graphs of their own
(``stream_graph_settings``; default: the same settings as the one-pass decode's).
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from omni_triton.models.code2wav.vocoder import Code2Wav, Code2WavConfig, set_phase_split
from omni_triton.models.code2wav.graphs import Code2WavGraphs, GraphSettings
from omni_triton.models.code2wav.stateful import (CODES_NAME, LENGTHS_NAME, NEW_STATE_PREFIX, WAVEFORM_NAME,
                                                  StateSpec, StreamingCode2Wav, chunk_samples)
from omni_triton.models.layers.fast_kernels import set_fast_kernels

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
        self._state_specs: list[StateSpec] | None = None

    def output_length(self, num_frames: int) -> int:
        return num_frames * self.samples_per_frame - self.trim_samples

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, G, N] integer ids -> waveform float32 [B, N * samples_per_frame - trim] on ``device``."""
        if codes.dim() != 3 or codes.shape[1] != self.num_quantizers or codes.shape[2] < 1:
            raise ValueError(f"codes must be [B, {self.num_quantizers}, N >= 1], got {tuple(codes.shape)}")
        return self._run(codes.to(self.device, torch.long).contiguous())

    def _run(self, codes: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    streams = False  # decode_stream available

    def streaming_samples(self, decoded_frames: int, new_frames: int) -> int:
        """New samples of a ``decode_stream`` row: ``new_frames`` after ``decoded_frames``."""
        return chunk_samples(self.samples_per_frame, self.trim_samples, decoded_frames, new_frames)

    def state_specs(self) -> list[StateSpec]:
        """Per-stream state layout of ``decode_stream`` (fp32 for the exported backends)."""
        if self._state_specs is None:  # checked on every call: built once
            self._state_specs = self._build_state_specs()
        return self._state_specs

    def _build_state_specs(self) -> list[StateSpec]:
        with torch.device("meta"):
            return StreamingCode2Wav(Code2Wav(self.config)).state_specs()

    def decode_stream(self, codes: torch.Tensor, lengths: torch.Tensor,
                      state: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """codes [B, G, T] (row b: ``lengths[b]`` new frames, then padding), lengths [B] int64 and state
        (``state_specs``, on ``device``) -> waveform float32 [B, T * samples_per_frame] (row b's first
        ``StreamingCode2Wav.new_samples`` samples are new audio) and the new state. Raises ValueError for a
        state of the wrong count, shape or dtype."""
        if not self.streams:
            raise ValueError(f"the {self.kind} Code2Wav runtime has no streaming state (decode_stream)")
        if codes.dim() != 3 or codes.shape[1] != self.num_quantizers or codes.shape[2] < 1:
            raise ValueError(f"codes must be [B, {self.num_quantizers}, T >= 1], got {tuple(codes.shape)}")
        batch = codes.shape[0]
        if tuple(lengths.shape) != (batch,):
            raise ValueError(f"lengths must be [{batch}], got {tuple(lengths.shape)}")
        check_state(state, self.state_specs(), batch)
        waveform, *new_state = self._run_stream(codes.to(self.device, torch.long).contiguous(),
                                                lengths.to(self.device, torch.long), state)
        return waveform.float(), new_state

    def _run_stream(self, codes, lengths, state) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    @staticmethod
    def create(kind: str, checkpoint_dir: str | Path, *, onnx_path: str | Path | None = None,
               plan_path: str | Path | None = None, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32, load_format: str = "safetensors",
               seed: int = 0, cuda_graphs: bool = False,
               graph_settings: GraphSettings = GraphSettings(),
               stream_graph_settings: GraphSettings | None = None,
               cudnn_autotune: bool = False, dilated_phases: bool = False,
               triton_snake: bool = False) -> "Code2WavRuntime":
        """``load_format``/``seed``: the torch backend's weights (``models.weights.load_code2wav``).
        ``cuda_graphs``/``graph_settings``/``stream_graph_settings``: the torch backend's graph replay of short
        one-pass / ``decode_stream`` calls, on CUDA only (the TensorRT and ONNX Runtime backends ignore them).
        ``cudnn_autotune``: the torch backend on CUDA has cuDNN time its convolution algorithms per shape
        (``torch.backends.cudnn.benchmark``, process-wide) instead of taking its heuristic's pick.
        ``dilated_phases``: the torch backend on CUDA runs its dilated convolutions as undilated ones over the
        input's phases (``phase_conv``), which the heuristic serves with its fast kernels.
        ``triton_snake``: the torch backend on CUDA runs the vocoder's SnakeBeta activations as one fused Triton
        kernel each (``kernels.snake``) instead of torch's five to six elementwise launches."""
        if kind not in KINDS:
            raise ValueError(f"Code2Wav runtime kind {kind!r} is not one of {KINDS}")
        device = torch.device(device)
        if kind == "auto":
            kind = _pick_auto(onnx_path, plan_path, device)
        config = Code2WavConfig.from_pretrained(checkpoint_dir)
        if kind == "torch":
            return TorchCode2Wav(checkpoint_dir, config, device, dtype, load_format, seed,
                                 cuda_graphs=cuda_graphs, graph_settings=graph_settings,
                                 stream_graph_settings=stream_graph_settings, cudnn_autotune=cudnn_autotune,
                                 dilated_phases=dilated_phases, triton_snake=triton_snake)
        if kind == "onnxruntime":
            return OnnxRuntimeCode2Wav(_existing(onnx_path, "onnx_path"), config, device)
        return TensorRTCode2Wav(_existing(plan_path, "plan_path"), config, device)


def check_state(state: list[torch.Tensor], specs: list[StateSpec], batch: int) -> None:
    """ValueError naming the first state tensor whose count, shape or dtype is not ``specs`` for ``batch`` rows."""
    if len(state) != len(specs):
        raise ValueError(f"streaming state has {len(state)} tensors, expected {len(specs)}")
    for tensor, spec in zip(state, specs):
        if tuple(tensor.shape) != (batch, *spec.shape) or tensor.dtype != spec.dtype:
            raise ValueError(f"streaming state {spec.name!r} is {tuple(tensor.shape)} {tensor.dtype}, expected "
                             f"{(batch, *spec.shape)} {spec.dtype}")


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
                 graph_settings: GraphSettings = GraphSettings(),
                 stream_graph_settings: GraphSettings | None = None, cudnn_autotune: bool = False,
                 dilated_phases: bool = False, triton_snake: bool = False):
        super().__init__(config, device)
        from omni_triton.models.weights import load_code2wav

        if cudnn_autotune and device.type == "cuda":
            # Set before the graphs below are captured: their warm-up calls time each shape's algorithms, the
            # capture records the fastest. cuDNN's heuristic alone picks a generic non-tensor-core kernel for some
            # of the bf16 convolutions here (a third of a call's GPU time at full size on an H200). Process-wide,
            # and the code2wav stage runs nothing else; the in-process pipeline (the reference) leaves it off.
            torch.backends.cudnn.benchmark = True

        self.model = load_code2wav(checkpoint_dir, device, dtype, load_format=load_format, seed=seed)
        set_phase_split(self.model, dilated_phases and device.type == "cuda")  # before the graphs capture the convs
        # Before the graphs below are captured: their warm-up calls compile the kernel for each shape, the capture
        # records its launches. The vocoder's only kernel switches are its SnakeBetas.
        set_fast_kernels(self.model, triton_snake and device.type == "cuda")
        # None: every call eager (CPU, or graphs off)
        self.graphs = (Code2WavGraphs(self._eager, self.num_quantizers, device, graph_settings)
                       if cuda_graphs and device.type == "cuda" else None)
        self.streaming = StreamingCode2Wav(self.model)
        # a batch bucket's static lengths and state inputs, shared by its graphs of every frame count (below)
        self._stream_static_inputs: dict[int, tuple[torch.Tensor, ...]] = {}
        # stream chunks: the same replay of short calls, state inputs and outputs included
        self.stream_graphs = (self._stream_graphs(stream_graph_settings or graph_settings)
                              if self.graphs is not None else None)

    streams = True

    def _stream_graphs(self, settings: GraphSettings) -> Code2WavGraphs | None:
        """None (stream chunks run eagerly, logged) when the capture at start fails: an optimisation only."""
        try:
            return Code2WavGraphs(self._eager_stream, self.num_quantizers, self.device, settings,
                                  capture_inputs=self._stream_capture_inputs)
        except RuntimeError as error:
            print(f"code2wav: CUDA graphs of stream chunks could not be captured, they run eagerly: {error}",
                  flush=True)
            return None

    def _stream_capture_inputs(self, bucket: int, frames: int) -> tuple[torch.Tensor, ...]:
        """A capture's static inputs: codes of its own shape; lengths and state (~2.6 MB a row at full size) one
        set per batch bucket, shared by the bucket's 15 frame counts. Sharing is safe because ``run`` fills every
        static input before each replay and replays one at a time (its lock); unshared they took 1.4 GB at max
        batch 8 with every batch size a bucket."""
        codes = torch.zeros(bucket, self.num_quantizers, frames, dtype=torch.long, device=self.device)
        shared = self._stream_static_inputs.get(bucket)
        if shared is None:
            lengths = torch.full((bucket,), frames, dtype=torch.long, device=self.device)
            shared = self._stream_static_inputs[bucket] = (lengths, *self.streaming.initial_state(bucket,
                                                                                                   self.device))
        else:  # a capture's warm-up and capture read these: the lengths of this shape, the initial state
            shared[0].fill_(frames)
            for static, initial in zip(shared[1:], self.streaming.initial_state(bucket, self.device)):
                static.copy_(initial)
        return (codes, *shared)

    @torch.inference_mode()
    def _eager_stream(self, codes, lengths, *state):
        return tuple(self.streaming(codes, lengths, *state))

    def _build_state_specs(self) -> list[StateSpec]:
        return self.streaming.state_specs()  # in the model's dtype

    @torch.inference_mode()
    def _run_stream(self, codes, lengths, state):
        if self.stream_graphs is not None and self.stream_graphs.serves(codes.shape):
            return self.stream_graphs.run(codes, lengths, *state)
        return self._eager_stream(codes, lengths, *state)

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
        # a --stateful export (build_engines/export_code2wav_onnx.py) takes new frames + state instead
        self.streams = LENGTHS_NAME in {i.name for i in self.session.get_inputs()}

    def _bind_run(self, inputs: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor]) -> None:
        """Run the session on torch tensors in place (IO binding by device pointer)."""
        import numpy as np

        device_type, device_id = self._ort_device
        with self._lock:
            binding = self.session.io_binding()
            for bind, tensors in ((binding.bind_input, inputs), (binding.bind_output, outputs)):
                for name, tensor in tensors.items():
                    dtype = np.int64 if tensor.dtype == torch.int64 else np.float32
                    bind(name, device_type, device_id, dtype, tuple(tensor.shape), tensor.data_ptr())
            if device_type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()  # inputs written by torch's stream
            self.session.run_with_iobinding(binding)

    def _run_stream(self, codes, lengths, state):
        specs = self.state_specs()
        batch, frames = codes.shape[0], codes.shape[2]
        inputs = {CODES_NAME: codes, LENGTHS_NAME: lengths,
                  **{spec.name: tensor.contiguous() for spec, tensor in zip(specs, state)}}
        waveform = torch.empty(batch, frames * self.samples_per_frame, dtype=torch.float32, device=self.device)
        new_state = [torch.empty_like(tensor) for tensor in state]
        self._bind_run(inputs, {WAVEFORM_NAME: waveform,
                                **{NEW_STATE_PREFIX + spec.name: t for spec, t in zip(specs, new_state)}})
        return (waveform, *new_state)

    def _run(self, codes: torch.Tensor) -> torch.Tensor:
        if self.streams:
            raise ValueError("this ONNX file is a --stateful export: it decodes with decode_stream only")
        out = torch.empty(codes.shape[0], self.output_length(codes.shape[2]), dtype=torch.float32, device=self.device)
        self._bind_run({INPUT_NAME: codes}, {OUTPUT_NAME: out})
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
