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
DEBIAN_PACKAGES=(libibverbs1 librdmacm1 libnuma1 libnl-3-200 libnl-route-3-200 g++)

missing=()
for pkg in "${DEBIAN_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
    echo "installing Debian packages: ${missing[*]}"
    SUDO=$([ "$(id -u)" -eq 0 ] || echo sudo)
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
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
fi
.venv/bin/python -c "import sglang, mooncake.engine, lynx_patches" \
    || { echo "install check failed: sglang / mooncake / lynx_patches do not import" >&2; exit 1; }
# The codec's kernels are x86-64 only; elsewhere the servers warn and run the torch reference.
[ "$(uname -m)" != x86_64 ] || .venv/bin/python -c "from lynx.codec import cpp_backend; cpp_backend.module()" \
    || { echo "install check failed: the C++ CPU codec does not load (above: why)" >&2; exit 1; }
