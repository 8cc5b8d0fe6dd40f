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

# Servers started in the background, by name: `launch` one (its GPUs, its ports), `wait_ready` for some,
# `stop_servers` for all. `serve` / `stop_server` are the one-server form (ports 18000-18002, the GPUs inherited).
declare -A server_pids server_ports
server_pid= server_gpus=  # server_gpus: the GPUs launched servers were given ("" = all), whose memory stop_servers watches

launch() {  # $1: name (run dir and log under $logs), $2: CUDA_VISIBLE_DEVICES ("" inherits), $3: HTTP port (gRPC
  # +1, metrics +2); then more serve flags
  local name=$1 devices=$2 port=$3; shift 3
  say "serve $name${devices:+ on GPU(s) $devices}, ports $port-$((port + 2)): $MODEL_ARGS $SERVE_ARGS $*"
  ( [ -z "$devices" ] || export CUDA_VISIBLE_DEVICES=$devices
    exec python3 -m omni_triton.cli serve $MODEL_ARGS --max-inflight 64 $SERVE_ARGS "$@" --run-dir "$logs/$name" \
      --http-port "$port" --grpc-port $((port + 1)) --metrics-port $((port + 2)) ) >"$logs/$name.log" 2>&1 &
  server_pids[$name]=$!
  server_ports[$name]=$port
  [ -z "$devices" ] && server_gpus=all || [ "$server_gpus" = all ] || server_gpus=${server_gpus:+$server_gpus,}$devices
}

port_of() { echo "${server_ports[$1]}"; }

wait_ready() {  # $1: seconds; then names: 0 once every one answers ready, 1 (with the logs' tails) if one did not
  local deadline=$((SECONDS + $1)) name pending
  shift
  pending=("$@")
  while [ ${#pending[@]} -gt 0 ] && [ $SECONDS -lt $deadline ]; do
    local still=()
    for name in "${pending[@]}"; do
      if url_up "http://127.0.0.1:${server_ports[$name]}/v2/health/ready"; then
        say "serve $name ready"; grep -E "KV cache|GiB|prefix" "$logs/$name.log" | head -5 | tee -a "$logs/stages.log"
      elif kill -0 "${server_pids[$name]}" 2>/dev/null; then
        still+=("$name")
      else
        say "serve $name: exited"; tail -30 "$logs/$name.log"; return 1
      fi
    done
    pending=("${still[@]}")
    [ ${#pending[@]} -eq 0 ] || sleep 1
  done
  [ ${#pending[@]} -eq 0 ] && return 0
  for name in "${pending[@]}"; do say "serve $name: not ready"; tail -30 "$logs/$name.log"; done
  return 1
}

stop_servers() {  # every launched server; the GPUs' memory is free again when it returns (or 60 s passed)
  local name
  for name in "${!server_pids[@]}"; do
    say "stop server $name"; stop_tree "${server_pids[$name]}"
    rm -rf "$logs/$name/repository"  # its tritonserver.log stays
  done
  local ids=$([ "$server_gpus" = all ] || echo "$server_gpus")  # other GPUs may be busy with other work
  server_pids=() server_ports=() server_pid= server_gpus=
  command -v nvidia-smi >/dev/null || return 0
  local used=(nvidia-smi ${ids:+-i "$ids"} --query-gpu=memory.used --format=csv,noheader,nounits)
  for _ in $(seq 60); do  # the next server plans its KV cache from the memory free at its launch
    [ "$("${used[@]}" | sort -n | tail -1)" -lt 2048 ] && return 0
    sleep 1
  done
  say "GPU memory still in use: $("${used[@]}" | tr '\n' ' ')"
}

serve() {  # $1: name, $2: seconds it may take to be ready; then more serve flags
  local name=$1 ready_s=$2; shift 2
  launch "$name" "" 18000 "$@"
  server_pid=${server_pids[$name]}
  wait_ready "$ready_s" "$name" && return 0
  stop_servers; return 1
}

stop_server() { stop_servers; }  # $1 (the name serve ran under) kept for the callers: one server at a time
