#!/usr/bin/env bash
# One worker of a TPU VM pod slice: run the same command on every worker (`gcloud compute tpus tpu-vm ssh NAME
# --worker=all --command=...`, see docs/launchers.md). The workers form one JAX program (jax.distributed, detected from the
# TPU VM's metadata: CISJAX_DISTRIBUTED=1), the mesh spans every chip of the slice. Rollouts come from cisjax's JAX
# sampler: without ROLLOUT, in the trainer's process on its chips (rollout.colocated: weights swapped in memory; a
# one-host slice only); with ROLLOUT, from running servers that worker 0 alone talks to, e.g. `cisjax serve --backend
# jax --mesh fsdp=-1` on a TPU host of its own (a multi-host slice needs this). vLLM-TPU servers work too, but vLLM-TPU
# 0.32 cannot load weights in place: `cisjax serve --backend vllm --device tpu` restarts the engine (reload and
# recompile, minutes) on every publish.
#
#   CONFIG=configs/FILE.py [ROLLOUT=HOST:PORT] bash launchers/tpu_pod.sh [--config.x=y ...] [--resume]
#
# Arguments go to `cisjax train` (--config.model.path=DIR: the model on every worker's disk). Environment:
#   CONFIG    the train config (required)
#   ROLLOUT   HOST:PORT of the rollout server, or HOST:PORT,HOST:PORT,... of several (a fleet: prompts spread over
#             them, weights to all); their token in CISJAX_ROLLOUT_TOKEN. Unset: the colocated JAX sampler
#   DTYPE     the colocated sampler's dtype (default bfloat16)
#   RUN       the run directory on each worker (default: run.dir of the config); worker 0 writes the metrics
#   CKPT_DIR  checkpoints: a directory every worker mounts (NFS, Filestore), each writes its shards there
#             (default: RUN/checkpoints, enough on a single-host slice only)
#   PUBLISH   with ROLLOUT: stream (default: weights go over gRPC, no shared filesystem) | disk: exported into
#             PUBLISH_DIR (worker 0's path) that the server sees as SERVER_DIR (under its --export-root)
#   TLS_CA    TLS to the rollout server(s): the CA that signed their certificates (`cisjax serve --tls-cert`); needed
#             when they bind a non-localhost address (docs/rollout.md: a CA for a cluster in a few commands)
#   TLS_CERT, TLS_KEY  mutual TLS: this slice's client certificate and key (the servers' --tls-client-ca signed it)
#   TLS_SERVER_NAME    the name the servers' certificates carry, when not the host in ROLLOUT
#   BIN       (.venv/bin)
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {  # the comment above; exit code $1 (2: bad input)
  sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
  exit "${1:-2}"
}
case "${1:-}" in -h | --help) usage 0 ;; esac
BIN=${BIN:-.venv/bin}
CONFIG=${CONFIG:-}
ROLLOUT=${ROLLOUT:-}
[ -n "$CONFIG" ] && [ -f "$CONFIG" ] || { echo "tpu_pod.sh: CONFIG=${CONFIG:-(unset)} is not a config file" >&2; usage; }
for a in "$@"; do
  case "$a" in --config.* | --resume) ;; *) echo "tpu_pod.sh: '$a' is not an argument of cisjax train" >&2; usage ;; esac
done

if [ -z "$ROLLOUT" ]; then  # the JAX sampler in this process, on the slice's chips
  [ -z "${PUBLISH:-}${TLS_CA:-}${TLS_CERT:-}${TLS_KEY:-}${TLS_SERVER_NAME:-}" ] \
    || { echo "tpu_pod.sh: PUBLISH and TLS_* are for ROLLOUT servers; the colocated sampler gets the weights in memory" >&2; usage; }
  args=(--config.rollout.server= --config.rollout.backend=jax --config.rollout.colocated=True
    --config.rollout.dtype="${DTYPE:-bfloat16}")
else
  [[ "$ROLLOUT" =~ ^[^:,[:space:]]+:[0-9]+(,[^:,[:space:]]+:[0-9]+)*$ ]] \
    || { echo "tpu_pod.sh: ROLLOUT=$ROLLOUT is not HOST:PORT[,HOST:PORT...]" >&2; usage; }
  PUBLISH=${PUBLISH:-stream}
  args=(--config.rollout.server="$ROLLOUT" --config.publish.mode="$PUBLISH")
  case "$PUBLISH" in
    stream) ;;
    disk)
      [ -n "${PUBLISH_DIR:-}" ] && [ -n "${SERVER_DIR:-}" ] \
        || { echo "tpu_pod.sh: PUBLISH=disk needs PUBLISH_DIR and SERVER_DIR" >&2; usage; }
      args+=(--config.publish.dir="$PUBLISH_DIR" --config.publish.server_dir="$SERVER_DIR") ;;
    *) echo "tpu_pod.sh: PUBLISH is stream or disk" >&2; usage ;;
  esac
  if [ -n "${TLS_CA:-}${TLS_CERT:-}${TLS_KEY:-}${TLS_SERVER_NAME:-}" ]; then
    [ -n "${TLS_CA:-}" ] || { echo "tpu_pod.sh: TLS_CERT, TLS_KEY and TLS_SERVER_NAME need TLS_CA" >&2; usage; }
    args+=(--config.rollout.tls_ca="$TLS_CA" --config.rollout.tls_cert="${TLS_CERT:-}" --config.rollout.tls_key="${TLS_KEY:-}")
    args+=(--config.rollout.tls_server_name="${TLS_SERVER_NAME:-}")
  fi
fi
if [ -n "${RUN:-}" ]; then
  args+=(--config.run.dir="$RUN")
fi
if [ -n "${CKPT_DIR:-}" ]; then
  args+=(--config.checkpoint.dir="$CKPT_DIR")
fi

# jax.distributed.initialize() before the first device is touched: the workers find each other through the TPU VM
# metadata (0 = a single-process run, e.g. one host)
export CISJAX_DISTRIBUTED=${CISJAX_DISTRIBUTED:-1}
exec "$BIN/cisjax" train --config "$CONFIG" "${args[@]}" "$@"
