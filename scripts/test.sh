#!/usr/bin/env bash
# Install everything (idempotent), then run the whole test suite: unit, integration
# (real Mooncake over loopback) and end-to-end (real SGLang servers on the CPU).
# Extra arguments go to pytest, e.g. `scripts/test.sh test/unit`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
exec .venv/bin/python -m pytest -ra --timeout=1800 "$@"
