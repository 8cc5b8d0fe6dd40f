"""Export Code2Wav to ONNX with dynamic batch and frame axes, then check it against torch with ONNX Runtime.

    python -m build_engines.export_code2wav_onnx --checkpoint checkpoints/tiny --out engines/code2wav.onnx

Uses the dynamo exporter (``torch.onnx.export(dynamo=True)``): the legacy TorchScript exporter bakes the
frame count into the transposed-conv trims and the sliding-window mask. Input ``codes`` int64 [B, G, N],
output ``waveform`` float32 [B, N * samples_per_frame - trim]. Weights go to an external ``<out>.data``
file when the model is too big for one protobuf (2 GB). The check runs frame counts below, at and above
the sliding window and prints the max abs error per count.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from omni_triton.models.audio_weights import load_code2wav
from omni_triton.models.code2wav import Code2Wav

INPUT_NAME, OUTPUT_NAME = "codes", "waveform"
PROTOBUF_LIMIT_BYTES = 2 * 1024**3
MAX_FRAMES = 8192


def export_code2wav_onnx(model: Code2Wav, out_path: str | Path, *, max_batch: int = 256,
                         max_frames: int = MAX_FRAMES) -> Path:
    """Write ``model`` (fp32, eval) to ``out_path``; returns the path."""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    example = torch.zeros(2, model.num_quantizers, model.sliding_window + 3, dtype=torch.long)
    batch = torch.export.Dim("batch", min=1, max=max_batch)
    frames = torch.export.Dim("frames", min=1, max=max_frames)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    with torch.inference_mode(False), torch.no_grad():
        program = torch.onnx.export(model.eval(), (example,), dynamo=True, input_names=[INPUT_NAME],
                                    output_names=[OUTPUT_NAME], dynamic_shapes=({0: batch, 2: frames},))
    program.save(str(out_path), external_data=weight_bytes > PROTOBUF_LIMIT_BYTES * 0.9)
    return out_path


def check_onnx(onnx_path: str | Path) -> None:
    """onnx.checker on the saved model (by path, so external data is fine)."""
    import onnx

    onnx.checker.check_model(str(onnx_path), full_check=True)


def compare_with_torch(onnx_path: str | Path, model: Code2Wav, frame_counts: list[int], batch: int = 2,
                       seed: int = 0) -> dict[int, float]:
    """Max abs error ORT vs torch on random codes, per frame count."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    session = ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
    generator = torch.Generator().manual_seed(seed)
    errors = {}
    for num_frames in frame_counts:
        codes = torch.randint(0, model.config.codebook_size, (batch, model.num_quantizers, num_frames),
                              generator=generator)
        with torch.inference_mode():
            expected = model(codes).numpy()
        (actual,) = session.run([OUTPUT_NAME], {INPUT_NAME: codes.numpy()})
        if actual.shape != expected.shape:
            raise ValueError(f"{num_frames} frames: ONNX output shape {actual.shape} != torch {expected.shape}")
        errors[num_frames] = float(np.abs(actual - expected).max())
    return errors


def default_frame_counts(model: Code2Wav) -> list[int]:
    window = model.sliding_window
    return [1, 7, window - 1, window, window + 1, 2 * window + 5]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", required=True, help="HF-format checkpoint directory")
    parser.add_argument("--out", required=True, help="output .onnx file")
    parser.add_argument("--skip-check", action="store_true", help="skip onnx.checker and the ORT comparison")
    parser.add_argument("--tolerance", type=float, default=1e-3, help="fail when ORT vs torch max abs error is above")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    print(f"[1/3] loading Code2Wav from {args.checkpoint}", flush=True)
    model = load_code2wav(args.checkpoint)
    params = sum(p.numel() for p in model.parameters())
    print(f"      {params / 1e6:.1f}M params, {model.num_quantizers} code groups, "
          f"sliding window {model.sliding_window} ({time.perf_counter() - start:.1f} s)", flush=True)
    print(f"[2/3] exporting to {args.out} (dynamo, dynamic batch and frames)", flush=True)
    out = export_code2wav_onnx(model, args.out)
    print(f"      done ({time.perf_counter() - start:.1f} s)", flush=True)
    if args.skip_check:
        return
    print("[3/3] onnx.checker + ONNX Runtime vs torch", flush=True)
    check_onnx(out)
    errors = compare_with_torch(out, model, default_frame_counts(model))
    for num_frames, error in errors.items():
        print(f"      {num_frames:5d} frames: max abs error {error:.2e}", flush=True)
    worst = max(errors.values())
    print(f"      max abs error {worst:.2e} ({time.perf_counter() - start:.1f} s)", flush=True)
    if worst > args.tolerance:
        raise SystemExit(f"ONNX Runtime differs from torch by {worst:.2e} > --tolerance {args.tolerance}")


if __name__ == "__main__":
    main()
