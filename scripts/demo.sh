#!/usr/bin/env bash
# Install everything (idempotent), then run the main job: prefill + decode + router on
# loopback serving SmolLM2-135M-Instruct, one chat completion, TTFT, clean shutdown.
# Extra arguments go to `python -m lynx.tools.demo` (see --help); `--link 20mbit` (root)
# runs it over a rate-limited link between two network namespaces, next to plain PD.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh
exec .venv/bin/python -m lynx.tools.demo "$@"
