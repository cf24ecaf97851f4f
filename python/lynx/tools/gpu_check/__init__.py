"""The GPU check: a prepared run on one CUDA host, a few minutes long, not part of CI.

    python -m lynx.tools.gpu_check                              # every step
    python -m lynx.tools.gpu_check --steps bytes,throughput --peak-gbps 3350
    python -m lynx.tools.gpu_check --plan                       # what would run; no CUDA touched

(``scripts/gpu_check.sh`` installs the repo with its ``cuda`` extra first.) One module per
step, run in this order, each selectable with ``--steps``; each module's docstring states
what its step runs, on which device, what it reports and when it fails:

* ``codec_step``: the Triton codec tests on the GPU;
* ``bytes_step``: the Triton kernels' bytes = the torch reference's = the C++ codec's;
* ``throughput_step``: codec GB/s as a fraction of the GPU's peak memory bandwidth;
* ``pd_step``: plain PD vs Lynx ``full`` vs ``speculative`` on one GPU, outputs equal.

Around them: ``options`` (the flags), ``device`` (the GPU, its peak bandwidth), ``common``
(what a step is given and returns), ``runner`` (runs the steps; the table, the JSON report,
the exit status: 0 every selected step ok, 1 a step failed or was not run, 2 a usage
error, 3 no CUDA device).
"""

from lynx.tools.gpu_check.bytes_step import compare_paths
from lynx.tools.gpu_check.codec_step import pytest_outcome
from lynx.tools.gpu_check.common import Context, Item, StepResult
from lynx.tools.gpu_check.device import Peak, peak_bandwidth
from lynx.tools.gpu_check.options import STEPS, Options, parse_args
from lynx.tools.gpu_check.pd_step import (
    Answer,
    TransferUnavailable,
    compare_outputs,
    evaluate_pd,
    resolve_transfer,
    server_commands,
)
from lynx.tools.gpu_check.runner import check, main
from lynx.tools.gpu_check.throughput_step import fraction_text, moved_nbytes

__all__ = [
    "STEPS",
    "Answer",
    "Context",
    "Item",
    "Options",
    "Peak",
    "StepResult",
    "TransferUnavailable",
    "check",
    "compare_outputs",
    "compare_paths",
    "evaluate_pd",
    "fraction_text",
    "main",
    "moved_nbytes",
    "parse_args",
    "peak_bandwidth",
    "pytest_outcome",
    "resolve_transfer",
    "server_commands",
]
