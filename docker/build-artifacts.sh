#!/usr/bin/env bash
# The compose `build` service: checkpoint -> Code2Wav ONNX -> TensorRT plan, into the shared artifacts volume.
#
#   OMNI_CHECKPOINT   "tiny" (default: write the tiny random checkpoint) or a checkpoint directory
#                     inside the container, e.g. /checkpoints/Qwen3-Omni-30B-A3B-Instruct (used in place)
#   CODE2WAV_RUNTIME  trt (default) | onnx | torch: which Code2Wav artifacts to build and serve
#   CODE2WAV_TRT_PRECISION  fp32 | fp16 | bf16; default fp16 on TensorRT 10, fp32 on TensorRT 11+, whose
#                     strongly typed networks take their precision from the ONNX model (no FP16 builder flag)
#
# Idempotent: a done-marker records what was built (checkpoint, runtime, TensorRT version, precision,
# source hash); a rerun with the same inputs exits at once, any change rebuilds. The triton service reads
# serve.env, written only once every step succeeded, so it serves what this script finished building.
set -euo pipefail
cd "$(dirname "$0")/.."  # the project root: build_engines/ and omni_triton/ are hashed below

artifacts="${ARTIFACTS_DIR:-/artifacts}"
checkpoint="${OMNI_CHECKPOINT:-tiny}"
runtime="${CODE2WAV_RUNTIME:-trt}"
marker="$artifacts/build.done"

case "$runtime" in
    trt | onnx | torch) ;;
    *) echo "build-artifacts: CODE2WAV_RUNTIME must be trt, onnx or torch, got '$runtime'" >&2; exit 2 ;;
esac

source_hash=$(find build_engines omni_triton -name '*.py' -print0 | sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16)
tensorrt_version=$(python3 -c "import tensorrt; print(tensorrt.__version__)" 2>/dev/null || echo none)
if [[ "${tensorrt_version%%.*}" =~ ^[0-9]+$ && "${tensorrt_version%%.*}" -ge 11 ]]; then
    precision="${CODE2WAV_TRT_PRECISION:-fp32}"
else
    precision="${CODE2WAV_TRT_PRECISION:-fp16}"
fi
build_key="checkpoint=$checkpoint runtime=$runtime tensorrt=$tensorrt_version precision=$precision source=$source_hash"

if [[ -f "$marker" && "$(cat "$marker")" == "$build_key" ]]; then
    echo "build-artifacts: up to date ($build_key)"
    exit 0
fi
rm -f "$marker"
mkdir -p "$artifacts/code2wav"

if [[ "$checkpoint" == tiny ]]; then
    checkpoint_dir="$artifacts/checkpoints/tiny"
    omni-triton build tiny --out "$checkpoint_dir"
else
    checkpoint_dir="$checkpoint"
    if [[ ! -f "$checkpoint_dir/config.json" ]]; then
        echo "build-artifacts: OMNI_CHECKPOINT=$checkpoint has no config.json (is the host directory mounted at /checkpoints?)" >&2
        exit 2
    fi
fi

onnx="$artifacts/code2wav/code2wav.onnx"
plan="$artifacts/code2wav/code2wav.plan"
engine=""
if [[ "$runtime" != torch ]]; then
    omni-triton build onnx --checkpoint "$checkpoint_dir" --out "$onnx"
    engine="$onnx"
fi
if [[ "$runtime" == trt ]]; then
    omni-triton build trt --onnx "$onnx" --out "$plan" --checkpoint "$checkpoint_dir" --precision "$precision"
    engine="$plan"
fi

# serve.env first, marker last: an interrupted build leaves no marker and reruns in full.
printf 'CHECKPOINT_DIR=%q\nCODE2WAV_RUNTIME=%q\nCODE2WAV_ENGINE=%q\n' "$checkpoint_dir" "$runtime" "$engine" \
    > "$artifacts/serve.env.tmp"
mv "$artifacts/serve.env.tmp" "$artifacts/serve.env"
echo "$build_key" > "$marker"
echo "build-artifacts: done ($build_key)"
