#!/usr/bin/env bash
# Install everything (idempotent), then run the whole test suite: unit, integration
# (real Mooncake over loopback) and end-to-end (real SGLang servers on the CPU).
# Extra arguments go to pytest, e.g. `scripts/test.sh test/unit`; the 30 slowest steps are
# listed at the end, to keep the suite within its 40 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
exec .venv/bin/python -m pytest -ra --durations=30 --timeout=1800 "$@"
