#!/usr/bin/env bash
# The compose `api` service: the OpenAI-compatible HTTP API in front of the `triton` service.
#
#   OMNI_API_ARGS  extra `omni-triton api` flags, e.g. "--log-level warning"
#
# The checkpoint the build service chose (serve.env) gives `usage` its token counts.
set -euo pipefail

# shellcheck source=docker/serve-env.sh
source "$(dirname "$0")/serve-env.sh"  # CHECKPOINT_DIR, CODE2WAV_RUNTIME, CODE2WAV_ENGINE

# OMNI_API_ARGS is split into words on purpose: it carries several flags.
# shellcheck disable=SC2086
exec omni-triton api \
    --triton-grpc "${TRITON_GRPC:-triton:8001}" \
    --host 0.0.0.0 --port 9000 \
    --checkpoint "$CHECKPOINT_DIR" \
    ${OMNI_API_ARGS:-}
