#!/usr/bin/env bash
# One GPU machine: the rollout server (`cisjax serve`, vLLM or the transformers engine on the local GPU(s)) in the
# background, or REPLICAS of them (a fleet: one per GPU group), then `cisjax train` against it (them) on the trainer's
# GPUs; the servers are stopped when the script exits (end of the run, error, Ctrl-C).
#
#   CONFIG=configs/FILE.py bash launchers/gpu_local.sh [--config.x=y ...] [--resume]
#
# Arguments go to `cisjax train` (the model is the config's model.path, or --config.model.path=DIR). Environment:
#   CONFIG       the train config (required)
#   MODEL        the HF model directory (default: model.path of the config and the arguments)
#   RUN          the run directory (default: run.dir of the config); exports, metrics, checkpoints, server log
#   SERVER_GPUS  CUDA_VISIBLE_DEVICES of the server (default 0); TP its tensor-parallel size (default: their count)
#   REPLICAS     rollout servers (default 1): SERVER_GPUS split into this many equal groups, in order, one server each
#                (TP = a group's size), on ports PORT, PORT+1, ..., logs RUN/rollout_server0.log, ...; the trainer
#                spreads prompts over them and publishes to all (docs/rollout.md, the rollout fleet)
#   TRAIN_GPUS   CUDA_VISIBLE_DEVICES of the trainer (default 0); its mesh spans them (--config.mesh.* to shape it)
#   GPU_MEM      the server's share of each of its GPUs' memory (default 0.45; serve's --gpu-memory-utilization: vLLM's
#                weights + KV cache; the transformers engine's torch memory cap, on a GPU only)
#   TRAIN_MEM    the trainer's share (XLA_PYTHON_CLIENT_MEM_FRACTION; default 0.45 when it shares a GPU with the
#                server, else JAX's own); GPU_MEM + TRAIN_MEM must stay below 1 on a shared GPU
#   PORT (50051), DTYPE (bfloat16: the engine's), MAX_LEN (vLLM context length; 0 = the model's), STARTUP_S (900)
#   BACKEND      vllm (default) or transformers (the torch reference engine: on the first GPU of its group when torch
#                sees one, else on the CPU, as in a run without a GPU)
#   BIN          the project's environment (default .venv/bin); PYTHON the interpreter (default BIN/python, or python3
#                where there is none: a GPU machine's own Python with this checkout on PYTHONPATH, cisjax run as
#                `python -m cisjax`); WHEELS the carried wheels installed when a module is missing (default
#                build/wheels; `make gpu-wheels`, launchers/carried_wheels.sh)
#   HOST         the address the servers bind (default 127.0.0.1; the trainer dials 127.0.0.1): another address lets
#                other hosts reach them (an eval, a measurement) and needs CISJAX_ROLLOUT_TOKEN and TLS
#   TLS_CERT, TLS_KEY  the servers serve TLS with this certificate (it must name 127.0.0.1, or set TLS_SERVER_NAME)
#                and key; TLS_CA the CA the trainer trusts (required with them); TLS_CLIENT_CA: mutual TLS, the servers
#                accept only clients this CA signed, the trainer presenting TLS_CLIENT_CERT / TLS_CLIENT_KEY
#                (docs/rollout.md: a CA in a few commands)
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {  # the comment above; exit code $1 (2: bad input)
  sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
  exit "${1:-2}"
}
case "${1:-}" in -h | --help) usage 0 ;; esac
BIN=${BIN:-.venv/bin}
if [ -z "${PYTHON:-}" ]; then
  PYTHON=python3
  [ -x "$BIN/python" ] && PYTHON=$BIN/python
fi
WHEELS=${WHEELS:-build/wheels}
CONFIG=${CONFIG:-}
PORT=${PORT:-50051}
BACKEND=${BACKEND:-vllm}
DTYPE=${DTYPE:-bfloat16}
SERVER_GPUS=${SERVER_GPUS:-0}
REPLICAS=${REPLICAS:-1}
TRAIN_GPUS=${TRAIN_GPUS:-0}
GPU_MEM=${GPU_MEM:-0.45}
MAX_LEN=${MAX_LEN:-0}
STARTUP_S=${STARTUP_S:-900}
[ -n "$CONFIG" ] && [ -f "$CONFIG" ] || { echo "gpu_local.sh: CONFIG=${CONFIG:-(unset)} is not a config file" >&2; usage; }
[[ "$PORT" =~ ^[0-9]+$ && "$STARTUP_S" =~ ^[0-9]+$ && "$MAX_LEN" =~ ^[0-9]+$ ]] || { echo "gpu_local.sh: PORT, STARTUP_S and MAX_LEN are integers" >&2; usage; }
[[ "$REPLICAS" =~ ^[1-9][0-9]*$ ]] || { echo "gpu_local.sh: REPLICAS=$REPLICAS is not a positive integer" >&2; usage; }
IFS=, read -r -a server_gpus <<<"$SERVER_GPUS"
n_gpus=${#server_gpus[@]}
if [ "$n_gpus" -lt "$REPLICAS" ] || [ $((n_gpus % REPLICAS)) -ne 0 ]; then
  echo "gpu_local.sh: SERVER_GPUS=$SERVER_GPUS ($n_gpus GPUs) does not split into REPLICAS=$REPLICAS equal groups" >&2
  usage
fi
per=$((n_gpus / REPLICAS))
case "$BACKEND" in vllm | transformers) ;; *) echo "gpu_local.sh: BACKEND is vllm or transformers" >&2; usage ;; esac
HOST=${HOST:-127.0.0.1}
tls_serve=() tls_train=()
if [ -n "${TLS_CERT:-}${TLS_KEY:-}${TLS_CA:-}${TLS_CLIENT_CA:-}" ]; then
  [ -n "${TLS_CERT:-}" ] && [ -n "${TLS_KEY:-}" ] && [ -n "${TLS_CA:-}" ] \
    || { echo "gpu_local.sh: TLS needs TLS_CERT and TLS_KEY (the servers') and TLS_CA (what the trainer trusts)" >&2; usage; }
  tls_serve=(--tls-cert "$TLS_CERT" --tls-key "$TLS_KEY")
  tls_train=(--config.rollout.tls_ca="$TLS_CA")
  if [ -n "${TLS_CLIENT_CA:-}" ]; then
    [ -n "${TLS_CLIENT_CERT:-}" ] && [ -n "${TLS_CLIENT_KEY:-}" ] \
      || { echo "gpu_local.sh: TLS_CLIENT_CA (mutual TLS) needs TLS_CLIENT_CERT and TLS_CLIENT_KEY" >&2; usage; }
    tls_serve+=(--tls-client-ca "$TLS_CLIENT_CA")
    tls_train+=(--config.rollout.tls_cert="$TLS_CLIENT_CERT" --config.rollout.tls_key="$TLS_CLIENT_KEY")
  fi
  [ -z "${TLS_SERVER_NAME:-}" ] || tls_train+=(--config.rollout.tls_server_name="$TLS_SERVER_NAME")
fi
for a in "$@"; do
  case "$a" in --config.* | --resume) ;; *) echo "gpu_local.sh: '$a' is not an argument of cisjax train" >&2; usage ;; esac
done

# cisjax from this checkout, as `python -m cisjax` (the same as .venv/bin/cisjax), also on a machine without the
# project's environment; the modules such a machine lacks from the carried wheels (removed at exit, below)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
source launchers/carried_wheels.sh
carried_wheels "$PYTHON" "$WHEELS"
remove_site() { [ -z "$CARRIED_SITE" ] || rm -rf "$CARRIED_SITE"; }
trap remove_site EXIT

# the model and run directory the trainer will use (the config with the arguments applied), unless given
resolved=$("$PYTHON" - "$CONFIG" "$@" <<'PY'
import sys
from cisjax import config
cfg = config.load(sys.argv[1], config.split_overrides(sys.argv[2:])[1])
print(cfg.model.path)
print(cfg.run.dir or "runs/default")
PY
)
MODEL=${MODEL:-$(sed -n 1p <<<"$resolved")}
RUN=${RUN:-$(sed -n 2p <<<"$resolved")}
[ -n "$MODEL" ] && [ -d "$MODEL" ] || { echo "gpu_local.sh: no model directory '$MODEL' (set MODEL or --config.model.path)" >&2; usage; }
mkdir -p "$RUN/exports"
RUN=$(cd "$RUN" && pwd)
TP=${TP:-$per}

# the servers' engine options: vLLM's; the transformers engine's GPU and memory cap when torch sees a GPU there
server_on_gpu=1
if [ "$BACKEND" = transformers ]; then
  CUDA_VISIBLE_DEVICES=${server_gpus[0]} "$PYTHON" -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' \
    2> /dev/null || server_on_gpu=0
fi
server_args=()
if [ "$BACKEND" = vllm ]; then
  server_args=(--gpu-memory-utilization "$GPU_MEM" --tensor-parallel-size "$TP" --max-model-len "$MAX_LEN")
elif [ "$server_on_gpu" = 1 ]; then
  server_args=(--device cuda --gpu-memory-utilization "$GPU_MEM")
else
  echo "gpu_local.sh: the rollout server (transformers) runs on the CPU: torch sees no GPU" >&2
fi
shared_gpus=()
for g in ${TRAIN_GPUS//,/ }; do
  case ",$SERVER_GPUS," in *",$g,"*) shared_gpus+=("$g") ;; esac
done
if [ "${#shared_gpus[@]}" -gt 0 ]; then
  TRAIN_MEM=${TRAIN_MEM:-0.45}
  awk -v a="$GPU_MEM" -v b="$TRAIN_MEM" 'BEGIN { exit !(a + b < 1) }' \
    || { echo "gpu_local.sh: GPU_MEM + TRAIN_MEM ($GPU_MEM + $TRAIN_MEM) must be below 1 on a shared GPU" >&2; exit 2; }
  if [ "$server_on_gpu" = 1 ]; then
    s=; [ "${#shared_gpus[@]}" = 1 ] || s=s
    echo "gpu_local.sh: GPU$s $(IFS=,; echo "${shared_gpus[*]}") shared: server ($BACKEND) $GPU_MEM, trainer (JAX)" \
      "$TRAIN_MEM of its memory" >&2
  fi
fi

server_pids=()
stop_server() {
  local pid
  for pid in ${server_pids[@]+"${server_pids[@]}"}; do
    if kill -0 "$pid" 2>/dev/null; then
      echo "gpu_local.sh: stopping rollout server $pid" >&2
      kill -TERM "$pid" 2>/dev/null || true  # it drains the calls in flight (10 s), then exits
    fi
  done
  for pid in ${server_pids[@]+"${server_pids[@]}"}; do
    for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
}
trap 'stop_server; remove_site' EXIT
trap 'exit 130' INT TERM

# each in its own session: a Ctrl-C at the terminal goes to the trainer (which finishes its step, publishing to the
# servers, and checkpoints), not to them; the trap above stops them once the trainer is done
logs=() offsets=() targets=()
for ((i = 0; i < REPLICAS; i++)); do
  gpus=$(IFS=,; echo "${server_gpus[*]:$((i * per)):$per}")
  port=$((PORT + i))
  log="$RUN/rollout_server.log"
  [ "$REPLICAS" = 1 ] || log="$RUN/rollout_server$i.log"
  echo "gpu_local.sh: starting rollout server $i ($BACKEND on GPUs $gpus, port $port, log $log)" >&2
  offsets+=("$(if [ -f "$log" ]; then wc -c <"$log"; else echo 0; fi)")  # appended to: --resume keeps the old log
  CUDA_VISIBLE_DEVICES=$gpus setsid "$PYTHON" -m cisjax serve --backend "$BACKEND" --model "$MODEL" --port "$port" \
    --host "$HOST" --dtype "$DTYPE" --export-root "$RUN/exports" ${server_args[@]+"${server_args[@]}"} \
    ${tls_serve[@]+"${tls_serve[@]}"} >>"$log" 2>&1 </dev/null &
  server_pids+=("$!")
  logs+=("$log")
  targets+=("127.0.0.1:$port")
done

# wait until they all serve before the trainer takes its GPU memory (vLLM sizes its KV cache from the memory free at
# start-up)
for ((i = 0; i < REPLICAS; i++)); do
  for ((waited = 0; ; waited++)); do
    tail -c +"$((offsets[i] + 1))" "${logs[i]}" 2>/dev/null | grep -q "listening on" && break
    if ! kill -0 "${server_pids[i]}" 2>/dev/null || [ "$waited" -ge "$((STARTUP_S * 2))" ]; then
      echo "gpu_local.sh: rollout server $i did not come up; its log ends:" >&2
      tail -n 30 "${logs[i]}" >&2
      exit 1
    fi
    sleep 0.5
  done
done
ROLLOUT=$(IFS=,; echo "${targets[*]}")
echo "gpu_local.sh: rollout server(s) serving on $ROLLOUT" >&2

trap ':' INT  # from here Ctrl-C is the trainer's (again to abort); the script goes on to stop the server
if [ -n "${TRAIN_MEM:-}" ]; then
  export XLA_PYTHON_CLIENT_MEM_FRACTION=$TRAIN_MEM
fi
CUDA_VISIBLE_DEVICES=$TRAIN_GPUS "$PYTHON" -m cisjax train --config "$CONFIG" --config.model.path="$MODEL" \
  --config.run.dir="$RUN" --config.rollout.server="$ROLLOUT" --config.publish.dir="$RUN/exports" \
  ${tls_train[@]+"${tls_train[@]}"} "$@"
