#!/usr/bin/env bash
# Install everything Lynx needs on a fresh Debian/Python 3.11 host, idempotently:
# the Debian libraries the Mooncake Transfer Engine loads and the C++ compiler of the
# codec, a virtual environment in .venv, and this repo (editable, its C++ CPU codec
# compiled in place) with SGLang, Mooncake (TCP build), the router and the test tools.
# Re-running it only checks what is there, and recompiles the codec after a change to
# its sources.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
# The Mooncake engine's libraries (libcurl4: its metadata client); the C++ codec's compiler
# and Python headers; venv (Debian ships it apart: without it `python3 -m venv` makes a .venv
# with no pip). A bare Debian 12 lacks libcurl4 and the last three.
DEBIAN_PACKAGES=(libibverbs1 librdmacm1 libnuma1 libnl-3-200 libnl-route-3-200 libcurl4 g++ "$PYTHON-venv" "$PYTHON-dev")

missing=()
for pkg in "${DEBIAN_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
    echo "installing Debian packages: ${missing[*]}"
    SUDO=$([ "$(id -u)" -eq 0 ] || echo sudo)
    if [ -n "$SUDO" ] && ! command -v sudo >/dev/null; then
        echo "install: run as root, or install sudo: the packages above are missing" >&2
        exit 1
    fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

# A .venv left half-made (e.g. by a venv without ensurepip) has a python but no pip: every
# later run would skip creating it and then fail. Made anew.
if [ -x .venv/bin/python ] && ! .venv/bin/python -m pip --version >/dev/null 2>&1; then
    echo "install: .venv has no working pip (a half-made venv): making it anew"
    rm -rf .venv
fi
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
stamp=.venv/.lynx-installed
codec_sources=(setup.py python/lynx/codec/cpp_build.py python/lynx/codec/csrc)
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ -n "$(find "${codec_sources[@]}" -newer "$stamp")" ]; then
    # This host's pip config lists local indexes that lack most packages; pip warns once per
    # package about each of them. Drop only those lines, keep every other message.
    # The requirements first: the codec compiles against the torch they install
    # (--no-build-isolation), which an isolated build would download again.
    {
        .venv/bin/python -m pip install -q --upgrade pip
        .venv/bin/python -m pip install -q -r <(.venv/bin/python docker/requirements.py cpu models test bench)
        .venv/bin/python -m pip install -q --no-deps --no-build-isolation -e .
    } 2> >(grep -v "^WARNING: Location 'file://" >&2)
    touch "$stamp"
    # PyPI's torch wheels (which sglang's pin takes) pull CUDA libraries even on a CPU-only
    # host; PyTorch's own CPU-only wheels are not on PyPI, so they are not used here.
    command -v nvidia-smi >/dev/null || echo "install: no GPU here; the venv still holds torch's CUDA libraries" \
        "(PyPI's torch wheels; the CPU-only ones live on download.pytorch.org, outside PyPI)"
    echo "install: .venv takes $(du -sh .venv | cut -f1) (about 10 GB: torch and its CUDA libraries)"
fi
.venv/bin/python -c "import sglang, mooncake.engine, lynx_patches" \
    || { echo "install check failed: sglang / mooncake / lynx_patches do not import" >&2; exit 1; }
# The codec's kernels are x86-64-v3; elsewhere (another architecture, or an x86 CPU without
# AVX2/FMA/F16C/BMI2) the servers warn once and run the torch reference (docs/cpu.md).
.venv/bin/python - <<'CHECK' || { echo "install check failed: the C++ CPU codec does not load (above: why)" >&2; exit 1; }
import platform, sys
from lynx.codec import cpp_backend
lacking = cpp_backend.cpu_lacks()
if platform.machine() != "x86_64" or lacking:
    why = f"this CPU lacks {', '.join(lacking)}" if lacking else f"this is {platform.machine()}, not x86-64"
    print(f"install: warning: {why}: the servers will run the torch reference codec (slower; docs/cpu.md)")
    sys.exit(0)
cpp_backend.module()
CHECK
