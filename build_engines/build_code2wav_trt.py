"""Build a TensorRT engine (plan) for Code2Wav from its ONNX export.

    python -m build_engines.build_code2wav_trt --onnx engines/code2wav.onnx --out engines/code2wav.plan \
        --checkpoint checkpoints/tiny --precision fp16

The optimization profile covers what the streaming decoder sends (omni_triton.pipeline.code2wav.chunking):
frames from 1 (a stream's last, short chunk) to ``left_context + chunk_frames``, optimised for a full
chunk; batch from 1 to ``--max-batch`` streams per call. Needs the ``tensorrt`` Python package (the NGC
TensorRT / Triton images have it); the equivalent ``trtexec`` command is printed either way.

``--stateful`` builds from a ``export_code2wav_onnx --stateful`` file: frames 1 to the largest chunk (no left
context), and a profile for ``lengths`` and every state input (batch varies, the rest is fixed by the model).
TensorRT does not run on the machines this project is developed on (no wheel reachable, no TensorRT on the GPU
machine): the build and the plan are untested here; the ONNX file they start from is checked with ONNX Runtime.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from omni_triton.models.code2wav.vocoder import Code2Wav, Code2WavConfig, exact_left_context_frames
from omni_triton.models.code2wav.stateful import CODES_NAME, LENGTHS_NAME, StreamingCode2Wav
from omni_triton.pipeline.code2wav.chunking import ChunkPolicy

INPUT_NAME = CODES_NAME
Profile = dict[str, dict[str, tuple]]  # input name -> {"min" | "opt" | "max": shape}


def profile_shapes(num_quantizers: int, policy: ChunkPolicy, opt_batch: int, max_batch: int) -> Profile:
    full_chunk = policy.left_context_frames + policy.chunk_frames
    return {INPUT_NAME: {"min": (1, num_quantizers, 1), "opt": (opt_batch, num_quantizers, full_chunk),
                         "max": (max_batch, num_quantizers, policy.max_frames_per_call())}}


def stateful_profile_shapes(config: Code2WavConfig, policy: ChunkPolicy, opt_batch: int, max_batch: int) -> Profile:
    """The streaming decoder's inputs: new frames only (1 to the largest chunk), lengths, each state tensor."""
    g = config.num_quantizers
    longest = max(policy.first_chunk_frames, policy.chunk_frames)
    shapes = {INPUT_NAME: {"min": (1, g, 1), "opt": (opt_batch, g, policy.chunk_frames), "max": (max_batch, g, longest)},
              LENGTHS_NAME: {"min": (1,), "opt": (opt_batch,), "max": (max_batch,)}}
    with torch.device("meta"):
        specs = StreamingCode2Wav(Code2Wav(config)).state_specs()
    for spec in specs:
        shapes[spec.name] = {"min": (1, *spec.shape), "opt": (opt_batch, *spec.shape), "max": (max_batch, *spec.shape)}
    return shapes


def trtexec_command(onnx_path: Path, plan_path: Path, shapes: Profile, precision: str, workspace_mib: int) -> str:
    def dims(which):
        return ",".join(f"{name}:" + "x".join(str(n) for n in shape[which]) for name, shape in shapes.items())

    flags = {"fp32": "", "fp16": " --fp16", "bf16": " --bf16"}[precision]
    return (f"trtexec --onnx={onnx_path} --saveEngine={plan_path} --minShapes={dims('min')} "
            f"--optShapes={dims('opt')} --maxShapes={dims('max')} --memPoolSize=workspace:{workspace_mib}{flags}")


def build_engine(onnx_path: Path, plan_path: Path, shapes: Profile, precision: str, workspace_mib: int) -> Path:
    import tensorrt as trt

    logger = trt.Logger(trt.Logger.INFO)
    builder = trt.Builder(logger)
    # TensorRT 10 networks are always explicit-batch; 8.x needs the flag
    explicit = getattr(trt.NetworkDefinitionCreationFlag, "EXPLICIT_BATCH", None)
    flags = 1 << int(explicit) if explicit is not None and int(trt.__version__.split(".")[0]) < 10 else 0
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):  # by path, so external weight files are found
        errors = "\n".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise SystemExit(f"TensorRT could not parse {onnx_path}:\n{errors}")

    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_mib << 20)
    if precision == "fp16":
        config.set_flag(trt.BuilderFlag.FP16)
    elif precision == "bf16":
        config.set_flag(trt.BuilderFlag.BF16)
    profile = builder.create_optimization_profile()
    for name, shape in shapes.items():
        profile.set_shape(name, shape["min"], shape["opt"], shape["max"])
    config.add_optimization_profile(profile)

    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise SystemExit("TensorRT engine build failed (see the log above)")
    plan_path.parent.mkdir(parents=True, exist_ok=True)
    plan_path.write_bytes(bytes(serialized))
    return plan_path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--onnx", required=True, type=Path, help="Code2Wav ONNX from export_code2wav_onnx")
    parser.add_argument("--out", required=True, type=Path, help="output plan file")
    parser.add_argument("--checkpoint", required=True, help="checkpoint directory (config.json: code groups, window)")
    parser.add_argument("--precision", choices=["fp32", "fp16", "bf16"], default="fp16")
    parser.add_argument("--workspace-mib", type=int, default=4096)
    parser.add_argument("--first-chunk-frames", type=int, default=ChunkPolicy.first_chunk_frames)
    parser.add_argument("--chunk-frames", type=int, default=ChunkPolicy.chunk_frames)
    parser.add_argument("--left-context-frames", type=int, default=None,
                        help="default: the exact left context of the model")
    parser.add_argument("--opt-batch", type=int, default=4)
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--stateful", action="store_true",
                        help="the ONNX file is the stateful streaming decoder (export_code2wav_onnx --stateful)")
    args = parser.parse_args(argv)

    config = Code2WavConfig.from_pretrained(args.checkpoint)
    policy = ChunkPolicy(args.first_chunk_frames, args.chunk_frames, args.left_context_frames).resolved(
        exact_left_context_frames(config))
    if not 1 <= args.opt_batch <= args.max_batch:
        raise SystemExit(f"need 1 <= --opt-batch ({args.opt_batch}) <= --max-batch ({args.max_batch})")
    shapes = (stateful_profile_shapes(config, policy, args.opt_batch, args.max_batch) if args.stateful
              else profile_shapes(config.num_quantizers, policy, args.opt_batch, args.max_batch))
    for name, shape in shapes.items():
        print(f"profile for {name}: min {shape['min']} opt {shape['opt']} max {shape['max']}", flush=True)
    print("equivalent trtexec command:\n  " + trtexec_command(args.onnx, args.out, shapes, args.precision,
                                                              args.workspace_mib), flush=True)
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        raise SystemExit("the 'tensorrt' Python package is not importable here: build inside the NGC TensorRT/"
                         "Triton image (docker compose build service) or run the trtexec command above") from None
    if not args.onnx.is_file():
        raise SystemExit(f"--onnx {args.onnx} does not exist (run build_engines.export_code2wav_onnx first)")
    start = time.perf_counter()
    print(f"building {args.precision} engine (workspace {args.workspace_mib} MiB)...", flush=True)
    build_engine(args.onnx, args.out, shapes, args.precision, args.workspace_mib)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.1f} MB) in {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
