"""Is the in-process pipeline itself deterministic on this device? The same requests run twice, alone.

If it is not, the served-vs-in-process audio comparison of served_device_check.py measures the engine's own
run-to-run variation, not Triton's.

    python benchmarks/gpu_backend_check/inprocess_determinism.py --device cuda --dtype float32
"""
import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch

from omni_triton.checkpoints.tiny import build
from omni_triton.client import build_inputs
from omni_triton.pipeline.inprocess import InProcessPipeline


def run(pipeline: InProcessPipeline, text: str, workload: dict) -> tuple[str, np.ndarray]:
    inputs = {t.name(): _array(t) for t in build_inputs(text, **workload)}
    out_text, audio = "", []
    for delta, chunk in pipeline.stream(inputs):
        out_text += delta
        if chunk is not None and chunk.numel():
            audio.append(chunk.float().cpu().numpy())
    return out_text, np.concatenate(audio) if audio else np.zeros(0, np.float32)


def _array(tensor):
    from tritonclient.utils import deserialize_bytes_tensor, triton_to_np_dtype
    if tensor.datatype() == "BYTES":
        return deserialize_bytes_tensor(tensor._raw_content).reshape(tensor.shape())
    return np.frombuffer(tensor._raw_content, dtype=triton_to_np_dtype(tensor.datatype())).reshape(tensor.shape())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--out", default="inprocess_determinism.json")
    args = parser.parse_args()
    checkpoint = build(Path(tempfile.mkdtemp()) / "tiny")
    pipeline = InProcessPipeline(checkpoint, device=args.device, dtype=getattr(torch, args.dtype))
    rows = []
    try:
        for index in range(args.requests):
            workload = dict(temperature=args.temperature, max_tokens=32, min_tokens=32, ignore_eos=True,
                            max_audio_frames=50, min_audio_frames=50, seed=index)
            text = f"Request number {index}: tell me something."
            (text_a, audio_a), (text_b, audio_b) = run(pipeline, text, workload), run(pipeline, text, workload)
            same_length = len(audio_a) == len(audio_b)
            diff = float(np.abs(audio_a - audio_b).max()) if same_length and len(audio_a) else None
            rows.append({"request": index, "text_equal": text_a == text_b, "audio_max_abs_diff": diff})
            print(rows[-1], flush=True)
    finally:
        pipeline.close()
    Path(args.out).write_text(json.dumps({"device": args.device, "dtype": args.dtype, "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
