# Sourced by the entrypoint scripts (serve.sh, api.sh): what the build service wrote, or exit 2 saying so.
#   CHECKPOINT_DIR, CODE2WAV_RUNTIME, CODE2WAV_ENGINE
# shellcheck shell=bash
serve_env="${ARTIFACTS_DIR:-/artifacts}/serve.env"
if [[ ! -f "$serve_env" ]]; then
    echo "$(basename "$0" .sh): $serve_env is missing: run the build service first (docker compose up runs it)" >&2
    exit 2
fi
# shellcheck source=/dev/null
source "$serve_env"
