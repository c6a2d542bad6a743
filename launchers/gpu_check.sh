#!/usr/bin/env bash
# One call checks a GPU machine (docs/gpu.md), in the order of what it teaches: the RL loop (the demo's warm-up, 64
# steps of `cisjax train` with the colocated JAX sampler, launchers/gpu_local.sh with the transformers engine as a
# server on the same GPU), the JAX sampler (prefill and decode tokens/s, the memory roofline, transformers' generate,
# the logprobs against the trainer's), the train step of the full-width 4-layer Qwen1.5-MoE-A2.7B cut at 4 x 2048,
# 8 x 2048 and 1 x 16384 tokens, every MoE dispatch impl and attention core against a float64 reference, the MoE layer
# against a dense MLP of equal active FLOPs at the paper's three layer shapes, and transformers' step. Each part's
# seconds are estimated first (cisjax.bench.gpu_budget): what BUDGET_S cannot hold is deferred, and the command of the
# next call that runs it is printed. One JSON, printed tables, profiler traces of one train and one decode step.
# `--only tune` runs the block sweep of the Hopper grouped matmuls (minutes: a call of its own; docs/gpu.md).
# It installs nothing into the environment: it runs on the JAX, torch and transformers it finds and records their
# versions. Without a GPU it runs the same sections at toy sizes (a few minutes on a CPU). `--dry-run` prints the plan.
#
#   OUT=DIR bash launchers/gpu_check.sh [--only SECTION ...] [--size auto|full|small] [--impls default|all] [--dry-run]
#
# Arguments go to `python -m cisjax.bench.gpu_check` (--help lists them). Environment:
#   OUT       the folder of gpu_check.json and the traces (default runs/gpu_check)
#   BUDGET_S  seconds for the whole check (default 540: one device call of 10 minutes, the machine's start aside)
#   PYTHON    the interpreter (default .venv/bin/python where there is one, else python3)
#   WHEELS    a folder of carried wheels (default build/wheels; `make gpu-wheels`), used only when ml_collections,
#             math_verify, grpc_tools or tensorboardX is missing (the configs, the rewards, the rollout stubs, the
#             trainer's event files): installed with pip --no-index --no-deps into a temporary folder put first on
#             PYTHONPATH, never into the environment (launchers/carried_wheels.sh). Carry recipe: docs/gpu.md
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {  # the comment above; exit code $1 (2: bad input)
  sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
  exit "${1:-2}"
}
case "${1:-}" in -h | --help) usage 0 ;; esac
OUT=${OUT:-runs/gpu_check}
BUDGET_S=${BUDGET_S:-540}
WHEELS=${WHEELS:-build/wheels}
if [ -z "${PYTHON:-}" ]; then
  PYTHON=python3
  [ -x .venv/bin/python ] && PYTHON=.venv/bin/python
fi
[[ "$BUDGET_S" =~ ^[0-9]+([.][0-9]+)?$ ]] || { echo "BUDGET_S=$BUDGET_S is not a number of seconds" >&2; usage 2 >&2; }

# JAX's GPU client reserves 75% of the GPU's memory by default, and that cap binds: the full-width cut's step at
# 8 x 2048 tokens ran out of memory with 47 GiB of temporaries under it on an H200. 0.93 leaves the rest to the CUDA
# context and the cuBLAS / cuDNN workspaces. The torch baseline runs after JAX's processes have ended (never beside).
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.93}
# the package from this checkout (a GPU machine has no .venv of the project: its Python and packages are its own)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

# the carried wheels (ml_collections for the train-step sections' configs/base.py, ...) when a module is missing
source launchers/carried_wheels.sh
carried_wheels "$PYTHON" "$WHEELS"
[ -z "$CARRIED_SITE" ] || trap 'rm -rf "$CARRIED_SITE"' EXIT

mkdir -p "$OUT"
# One persistent compilation cache for every process of the check (the loop's two trainers compile the same step),
# in a folder of its own that goes with the check (JAX_COMPILATION_CACHE_DIR set: that one, kept).
if [ -z "${JAX_COMPILATION_CACHE_DIR:-}" ]; then
  JAX_COMPILATION_CACHE_DIR=$(mktemp -d)
  trap 'rm -rf "$JAX_COMPILATION_CACHE_DIR" ${CARRIED_SITE:+"$CARRIED_SITE"}' EXIT
fi
export JAX_COMPILATION_CACHE_DIR JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=${JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS:-0}
"$PYTHON" -m cisjax.bench.gpu_check --out "$OUT/gpu_check.json" --budget-s "$BUDGET_S" --trace-dir "$OUT" "$@"
