#!/usr/bin/env bash
# One call checks a GPU machine (docs/gpu.md): every MoE dispatch impl and attention core against a float64 reference
# (values and gradients, ragged and empty expert groups, fp32 and bf16), the MoE layer against a dense MLP of equal
# active FLOPs at the paper's three layer shapes, the train step of the full-width 4-layer Qwen1.5-MoE-A2.7B cut per MoE
# impl at 4 x 2048, 8 x 2048 and 1 x 16384 tokens (tokens/s, MFU, peak memory; out of memory recorded as such), and
# transformers' step on the same GPU in a process of its own. One JSON and a printed table, within BUDGET_S seconds.
# `--only tune` runs the block sweep of the Hopper grouped matmuls instead (minutes: a second call; docs/gpu.md).
# It installs nothing into the environment: it runs on the JAX, torch and transformers it finds and records their
# versions. Without a GPU it runs the same sections at toy sizes (about a minute on a CPU).
#
#   OUT=DIR bash launchers/gpu_check.sh [--only SECTION ...] [--size auto|full|small]
#
# Arguments go to `python -m cisjax.bench.gpu_check` (--help lists them). Environment:
#   OUT       the folder of gpu_check.json (default runs/gpu_check)
#   BUDGET_S  seconds for the whole check (default 330: within 6 minutes on one H100 / H200, start-up aside)
#   PYTHON    the interpreter (default .venv/bin/python where there is one, else python3)
#   WHEELS    a folder of carried pure-Python wheels (default build/wheels), used only when ml_collections is missing
#             (configs/base.py, read by the train-step sections, needs it): installed with pip --no-index --no-deps
#             into a temporary folder put on PYTHONPATH, never into the environment. Carry recipe: docs/gpu.md
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {  # the comment above; exit code $1 (2: bad input)
  sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
  exit "${1:-2}"
}
case "${1:-}" in -h | --help) usage 0 ;; esac
OUT=${OUT:-runs/gpu_check}
BUDGET_S=${BUDGET_S:-330}
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

if ! "$PYTHON" -c "import ml_collections" 2> /dev/null; then
  if compgen -G "$WHEELS/*.whl" > /dev/null; then
    SITE=$(mktemp -d)
    trap 'rm -rf "$SITE"' EXIT
    "$PYTHON" -m pip install --quiet --no-index --no-deps --target "$SITE" "$WHEELS"/*.whl
    export PYTHONPATH="$PYTHONPATH:$SITE"
  else
    echo "ml_collections is missing and $WHEELS holds no wheel: the train-step sections will say so (docs/gpu.md)" >&2
  fi
fi

mkdir -p "$OUT"
"$PYTHON" -m cisjax.bench.gpu_check --out "$OUT/gpu_check.json" --budget-s "$BUDGET_S" "$@"
