#!/usr/bin/env bash
# The chaos drill of speculative mode (docs/transfer.md, "Trust model"): real prefill,
# decode and router on the tiny test model, 64 clients for 3 minutes while prefill is
# killed, restarted and stalled and forged notices reach decode. Prints the figures;
# exits 1 on any wrong output, leaked page or hung request.
# Extra arguments go to `python -m lynx.tools.soak` (e.g. --duration 600 --clients 32).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh >/dev/null
.venv/bin/python -m lynx.tools.models tiny >/dev/null
exec .venv/bin/python -m lynx.tools.soak --model "$HOME/.cache/lynx/models/tiny-llama-s0" "$@"
