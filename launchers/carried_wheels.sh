# Sourced by the launchers (gpu_check.sh, gpu_local.sh), not run: the modules cisjax needs that a machine's own Python
# may lack, from wheels carried with the checkout (`make gpu-wheels` fills build/wheels; docs/gpu.md, the carry recipe).
#
#   source launchers/carried_wheels.sh
#   carried_wheels PYTHON WHEELS [MODULE ...]
#
# When any MODULE (default: CARRIED_MODULES) does not import with PYTHON, every wheel in WHEELS is installed with pip
# --no-index --no-deps into a new temporary folder, put FIRST on PYTHONPATH (exported): the carried grpcio and protobuf
# then win over older ones of the machine, which the stubs grpcio-tools generates would refuse. Nothing is installed
# into the environment. One line on stderr says what was missing and what was installed (or that WHEELS holds no
# wheel); CARRIED_SITE names the folder (the caller removes it when done), empty when nothing was installed. Returns
# non-zero only when pip fails.

# configs/base.py (ml_collections), the rewards (math_verify), the rollout stubs (grpc_tools), the trainer's event
# files (tensorboardX; run.tensorboard)
CARRIED_MODULES=(ml_collections math_verify grpc_tools tensorboardX)

_carried_missing() {  # the modules of "$@" (after the python) that do not import with $1
  "$1" - "${@:2}" <<'PY'
import importlib, sys
missing = []
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception:  # absent, or broken (an older dependency): carried
        missing.append(name)
print(" ".join(missing))
PY
}

carried_wheels() {
  local python=$1 wheels=$2 missing still names
  shift 2
  [ $# -gt 0 ] || set -- "${CARRIED_MODULES[@]}"
  CARRIED_SITE=
  missing=$(_carried_missing "$python" "$@")
  [ -n "$missing" ] || return 0
  if ! compgen -G "$wheels/*.whl" > /dev/null; then
    echo "carried_wheels: $missing missing and $wheels holds no wheel (make gpu-wheels; docs/gpu.md)" >&2
    return 0
  fi
  CARRIED_SITE=$(mktemp -d "${TMPDIR:-/tmp}/cisjax_site.XXXXXX")
  "$python" -m pip install --quiet --no-index --no-deps --disable-pip-version-check --target "$CARRIED_SITE" \
    "$wheels"/*.whl || {
    local rc=$?
    echo "carried_wheels: pip could not install $wheels/*.whl for $python (make gpu-wheels: Python 3.12, x86-64)" >&2
    return "$rc"
  }
  export PYTHONPATH="$CARRIED_SITE${PYTHONPATH:+:$PYTHONPATH}"
  names=$(cd "$wheels" && ls -- *.whl | sed 's/-py[0-9].*\.whl$//; s/-cp[0-9].*\.whl$//' | tr '\n' ' ')
  echo "carried_wheels: $missing missing: installed ${names% } from $wheels into $CARRIED_SITE" \
    "(first on PYTHONPATH)" >&2
  still=$(_carried_missing "$python" "$@")
  [ -z "$still" ] || echo "carried_wheels: still missing after that: $still" >&2
}
