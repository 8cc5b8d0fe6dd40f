# Sourced by the scripts that run on the lent GPU machine (a 10-minute limit per command): a time budget that
# each stage's timeout is cut from, a server started in the background and stopped with everything under it.
# The sourcing script sets BUDGET_S (seconds for the whole run), logs (a dir), MODEL_ARGS and SERVE_ARGS (serve
# flags) before calling these.

left() { echo $((BUDGET_S - SECONDS)); }
limit() {  # $1: the stage's own limit, $2: seconds the stages after it need; prints the smaller allowance
  local allowed=$(($(left) - $2))
  if [ "$allowed" -lt "$1" ]; then  # said on stderr: a stage cut short by a small BUDGET_S must not look broken
    echo "[budget] a stage gets ${allowed}s of its ${1}s (BUDGET_S=$BUDGET_S, ${SECONDS}s gone)" >&2
    echo $((allowed > 5 ? allowed : 5))
  else
    echo "$1"
  fi
}
say() { echo "[$(date -u +%T) +${SECONDS}s] $*" | tee -a "$logs/stages.log"; }
url_up() { python3 -c "import urllib.request; urllib.request.urlopen('$1', timeout=2)" 2>/dev/null; }

tree_of() {  # $1 and every process under it (tritonserver runs in a session of its own: no group kill reaches it)
  echo "$1"
  local child
  for child in $(ps -o pid= --ppid "$1" 2>/dev/null); do tree_of "$child"; done
}

stop_tree() {  # $1: a pid started here: INT (serve stops tritonserver itself), then KILL what is left of its tree
  [ -n "$1" ] || return 0
  local pids
  pids=$(tree_of "$1")
  kill -INT "$1" 2>/dev/null
  for _ in $(seq 60); do kill -0 "$1" 2>/dev/null || break; sleep 0.5; done
  kill -KILL $pids 2>/dev/null
  wait "$1" 2>/dev/null
}

server_pid=
serve() {  # $1: name (run dir and log under $logs), $2: seconds it may take to be ready; then more serve flags
  local name=$1 ready_s=$2; shift 2
  say "serve $name: $MODEL_ARGS $SERVE_ARGS $*"
  python3 -m omni_triton.cli serve $MODEL_ARGS --max-inflight 64 $SERVE_ARGS "$@" \
    --run-dir "$logs/$name" --http-port 18000 --grpc-port 18001 --metrics-port 18002 \
    >"$logs/$name.log" 2>&1 &
  server_pid=$!
  local deadline=$((SECONDS + ready_s))
  while [ $SECONDS -lt $deadline ]; do
    if url_up http://127.0.0.1:18000/v2/health/ready; then
      say "serve $name ready"; grep -E "KV cache|GiB|prefix" "$logs/$name.log" | head -5 | tee -a "$logs/stages.log"
      return 0
    fi
    kill -0 $server_pid 2>/dev/null || break
    sleep 1
  done
  say "serve $name: not ready"; tail -30 "$logs/$name.log"; stop_server "$name"; return 1
}

stop_server() {  # $1: the name serve ran under; the GPU's memory is free again when it returns (or 60 s passed)
  say "stop server"; stop_tree "$server_pid"; server_pid=
  rm -rf "$logs/$1/repository"  # its tritonserver.log stays
  command -v nvidia-smi >/dev/null || return 0
  for _ in $(seq 60); do  # the next server plans its KV cache from the memory free at its launch
    [ "$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | sort -n | tail -1)" -lt 2048 ] && return 0
    sleep 1
  done
  say "GPU memory still in use: $(nvidia-smi --query-gpu=memory.used --format=csv,noheader | tr '\n' ' ')"
}
