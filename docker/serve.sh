#!/usr/bin/env bash
# The compose `triton` service: serve what the build service wrote into the artifacts volume.
#
#   OMNI_SERVE_ARGS  extra `omni-triton serve` flags, e.g. "--kv-cache-tokens 65536"
#
# `omni-triton serve` finds /opt/tritonserver/bin/tritonserver in this image and passes
# --allow-client-shm=true itself when the binary knows the flag (Triton >= 2.69, NGC 26.04+).
set -euo pipefail

# shellcheck source=docker/serve-env.sh
source "$(dirname "$0")/serve-env.sh"  # CHECKPOINT_DIR, CODE2WAV_RUNTIME, CODE2WAV_ENGINE

# OMNI_SERVE_ARGS is split into words on purpose: it carries several flags.
# shellcheck disable=SC2086
exec omni-triton serve \
    --checkpoint "$CHECKPOINT_DIR" \
    --device cuda \
    --host 0.0.0.0 --http-port 8000 --grpc-port 8001 --metrics-port 8002 \
    --code2wav-runtime "$CODE2WAV_RUNTIME" \
    ${CODE2WAV_ENGINE:+--code2wav-engine "$CODE2WAV_ENGINE"} \
    ${OMNI_SERVE_ARGS:-}
