"""Export Code2Wav to ONNX with dynamic batch and frame axes, then check it against torch with ONNX Runtime.

    python -m build_engines.export_code2wav_onnx --checkpoint checkpoints/tiny --out engines/code2wav.onnx

Uses the dynamo exporter (``torch.onnx.export(dynamo=True)``): the legacy TorchScript exporter bakes the
frame count into the transposed-conv trims and the sliding-window mask. Input ``codes`` int64 [B, G, N],
output ``waveform`` float32 [B, N * samples_per_frame - trim]. Weights go to an external ``<out>.data``
file when the model is too big for one protobuf (2 GB). The check runs frame counts below, at and above
the sliding window and prints the max abs error per count.

``--stateful`` exports the streaming decoder instead (``omni_triton/models/code2wav/stateful.py``): inputs
``codes`` int64 [B, G, T] (new frames only, rows right-padded), ``lengths`` int64 [B] and the state tensors
(``positions``, each layer's keys/values, each conv's past inputs: ``StreamingCode2Wav.state_specs``); outputs
``waveform`` float32 [B, T * samples_per_frame] and ``new_<name>`` for each state tensor. Its check streams
chunk splits through ONNX Runtime, state fed back each call, against torch's one-pass decode.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from omni_triton.models.weights import load_code2wav
from omni_triton.models.code2wav.vocoder import Code2Wav
from omni_triton.models.code2wav.stateful import (CODES_NAME, LENGTHS_NAME, NEW_STATE_PREFIX, WAVEFORM_NAME,
                                                  StreamingCode2Wav)

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


def export_streaming_onnx(model: Code2Wav, out_path: str | Path, *, max_batch: int = 256,
                          max_frames: int = MAX_FRAMES) -> Path:
    """Write ``StreamingCode2Wav(model)`` (fp32, eval) to ``out_path`` with dynamic batch and frame axes."""
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    streaming = StreamingCode2Wav(model.eval())
    specs = streaming.state_specs()
    batch = torch.export.Dim("batch", min=1, max=max_batch)
    frames = torch.export.Dim("frames", min=1, max=max_frames)
    # the example is a stream past its first chunk (positions > 0) beside a fresh one, ragged lengths
    codes = torch.zeros(2, model.num_quantizers, 5, dtype=torch.long)
    state = streaming.initial_state(2)
    state[0] = torch.tensor([7, 0])
    example = (codes, torch.tensor([5, 3]), *state)
    dynamic = ({0: batch, 2: frames}, {0: batch}, tuple({0: batch} for _ in specs))  # *state: one tuple
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    with torch.inference_mode(False), torch.no_grad():
        program = torch.onnx.export(
            streaming, example, dynamo=True, dynamic_shapes=dynamic,
            input_names=[CODES_NAME, LENGTHS_NAME, *(spec.name for spec in specs)],
            output_names=[WAVEFORM_NAME, *(NEW_STATE_PREFIX + spec.name for spec in specs)])
    program.save(str(out_path), external_data=weight_bytes > PROTOBUF_LIMIT_BYTES * 0.9)
    return out_path


def compare_streaming_with_torch(onnx_path: str | Path, model: Code2Wav, splits: list[list[int]],
                                 seed: int = 0) -> dict[str, float]:
    """Max abs error of ONNX Runtime's streamed waveform (chunks of ``splits[b]`` frames for stream b, all
    streams batched in each call, state fed back) against torch's one-pass decode, per stream."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    session = ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
    streaming = StreamingCode2Wav(model)
    names = [spec.name for spec in streaming.state_specs()]
    total = max(sum(split) for split in splits)
    codes = torch.randint(0, model.config.codebook_size, (len(splits), model.num_quantizers, total),
                          generator=torch.Generator().manual_seed(seed))
    state = [t.numpy() for t in streaming.initial_state(len(splits))]
    decoded, pieces = [0] * len(splits), [[] for _ in splits]
    for call in range(max(len(split) for split in splits)):
        lengths = [split[call] if call < len(split) else 0 for split in splits]
        rows = [b for b, n in enumerate(lengths) if n]
        longest = max(lengths)
        chunk = np.zeros((len(rows), model.num_quantizers, longest), dtype=np.int64)
        for row, b in enumerate(rows):
            chunk[row, :, :lengths[b]] = codes[b, :, decoded[b]:decoded[b] + lengths[b]].numpy()
        feeds = {CODES_NAME: chunk, LENGTHS_NAME: np.array([lengths[b] for b in rows], dtype=np.int64),
                 **{name: tensor[rows] for name, tensor in zip(names, state)}}
        waveform, *new_state = session.run(None, feeds)
        for row, b in enumerate(rows):
            pieces[b].append(waveform[row, :streaming.new_samples(decoded[b], lengths[b])])
            for tensor, new in zip(state, new_state):
                tensor[b] = new[row]
            decoded[b] += lengths[b]
    errors = {}
    with torch.inference_mode():
        for b, split in enumerate(splits):
            expected = model(codes[b:b + 1, :, :sum(split)])[0].numpy()
            actual = np.concatenate(pieces[b])
            if actual.shape != expected.shape:
                raise ValueError(f"stream {b}: streamed {actual.shape} samples != one pass {expected.shape}")
            errors["/".join(map(str, split))] = float(np.abs(actual - expected).max())
    return errors


def default_splits() -> list[list[int]]:
    """The 4/8/24/25 ramp, 1-frame chunks, a ragged split: batched together, starting at once."""
    return [[4, 8, 24, 25, 25], [1] * 5, [3, 30, 1, 7]]


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
    parser.add_argument("--stateful", action="store_true",
                        help="export the streaming decoder (new frames + state in, waveform + new state out)")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    print(f"[1/3] loading Code2Wav from {args.checkpoint}", flush=True)
    model = load_code2wav(args.checkpoint)
    params = sum(p.numel() for p in model.parameters())
    print(f"      {params / 1e6:.1f}M params, {model.num_quantizers} code groups, "
          f"sliding window {model.sliding_window} ({time.perf_counter() - start:.1f} s)", flush=True)
    kind = "stateful streaming decoder" if args.stateful else "one-pass decoder"
    print(f"[2/3] exporting the {kind} to {args.out} (dynamo, dynamic batch and frames)", flush=True)
    out = (export_streaming_onnx if args.stateful else export_code2wav_onnx)(model, args.out)
    print(f"      done ({time.perf_counter() - start:.1f} s)", flush=True)
    if args.skip_check:
        return
    print("[3/3] onnx.checker + ONNX Runtime vs torch", flush=True)
    check_onnx(out)
    errors = (compare_streaming_with_torch(out, model, default_splits()) if args.stateful
              else compare_with_torch(out, model, default_frame_counts(model)))
    for case, error in errors.items():
        print(f"      {case} frames: max abs error {error:.2e}", flush=True)
    worst = max(errors.values())
    print(f"      max abs error {worst:.2e} ({time.perf_counter() - start:.1f} s)", flush=True)
    if worst > args.tolerance:
        raise SystemExit(f"ONNX Runtime differs from torch by {worst:.2e} > --tolerance {args.tolerance}")


if __name__ == "__main__":
    main()
