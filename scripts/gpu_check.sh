#!/usr/bin/env bash
# The GPU check, on one CUDA host (not part of CI): install this repo with its cuda extra,
# then run python -m lynx.tools.gpu_check: the Triton codec tests on the GPU, the Triton
# kernels' bytes against the CPU codec's, codec throughput as a fraction of the GPU's memory
# bandwidth, and plain PD vs Lynx full vs Lynx speculative on one prefill and one decode
# server sharing the GPU. Prints a summary table and writes JSON (default
# benchmark/results/gpu_check.json). A few minutes once installed.
#
#   scripts/gpu_check.sh [--venv DIR | --no-venv] [--no-install] [CHECK ARGS...]
#
#   --venv DIR    the virtual environment to create (if missing) and use; default .venv-cuda
#                 (not .venv: that one holds the CPU build of Mooncake)
#   --no-venv     use the current Python ($PYTHON, default python3) instead
#   --no-install  skip installing this repo (editable) with the cuda and test extras; use what is installed
#   CHECK ARGS    go to python -m lynx.tools.gpu_check, e.g. --steps codec,bytes,throughput,pd
#                 --peak-gbps 3350 --out FILE --plan (print the JSON of what would run,
#                 touching no CUDA device); after -- all go there: -- --help lists them
#
# Exit status: the check's (0 every selected step ok, 1 a step failed or was not run, 3 no
# CUDA device), 2 for a usage error, 1 when the install fails or the venv is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
    exit "${1:-2}"
}

usage_error() {
    echo "gpu_check.sh: $*" >&2
    usage 2 >&2
}

die() {
    echo "gpu_check.sh: $*" >&2
    exit 1
}

VENV=.venv-cuda
USE_VENV=1
VENV_GIVEN=0
INSTALL=1
CHECK_ARGS=()
while (($#)); do
    case "$1" in
        --venv)
            (($# >= 2)) || usage_error "--venv needs a folder"
            VENV=$2
            VENV_GIVEN=1
            shift 2
            ;;
        --no-venv) USE_VENV=0; shift ;;
        --no-install) INSTALL=0; shift ;;
        -h | --help) usage 0 ;;
        --) shift; CHECK_ARGS+=("$@"); break ;;
        *) CHECK_ARGS+=("$1"); shift ;;
    esac
done
if ((VENV_GIVEN && !USE_VENV)); then
    usage_error "--venv and --no-venv exclude each other"
fi

PYTHON=${PYTHON:-python3}
if ((USE_VENV)); then
    if [ ! -x "$VENV/bin/python" ]; then
        ((INSTALL)) || die "no virtual environment at $VENV (drop --no-install to create it, or pass --no-venv)"
        echo "creating $VENV with $PYTHON"
        "$PYTHON" -m venv "$VENV"
        "$VENV/bin/python" -m pip install -q --upgrade pip
    fi
    PY=$VENV/bin/python
else
    command -v "$PYTHON" >/dev/null || die "no $PYTHON here (set PYTHON)"
    PY=$PYTHON
fi

if ((INSTALL)); then
    echo "installing this repo with the cuda and test extras into $("$PY" -c 'import sys; print(sys.prefix)')"
    # The requirements first: the C++ CPU codec compiles against the torch they install.
    "$PY" -m pip install -q -r <("$PY" docker/requirements.py cuda test) || die "installing the requirements failed"
    "$PY" -m pip install -q --no-deps --no-build-isolation -e . || die "pip install -e . failed"
    "$PY" -c "import sglang, mooncake.engine, triton, lynx_patches" \
        || die "install check failed: sglang / mooncake / triton / lynx_patches do not import"
fi

# This checkout's code, whatever else is installed.
export PYTHONPATH=python${PYTHONPATH:+:$PYTHONPATH}
exec "$PY" -m lynx.tools.gpu_check ${CHECK_ARGS[@]+"${CHECK_ARGS[@]}"}
