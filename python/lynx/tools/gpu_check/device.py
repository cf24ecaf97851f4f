"""The GPU the check runs on, and the peak memory bandwidth its figures are measured against.

Provides:
    cuda_device() - the first CUDA device's facts (name, capability, memory, count, torch's
        CUDA), or None when torch sees none. Touches CUDA: never called under ``--plan``.
    no_cuda_reason() - why torch sees no device (its build, CUDA_VISIBLE_DEVICES), for the
        report and the exit-3 message.
    peak_bandwidth(device_name, override) - the peak to measure against: ``--peak-gbps``,
        else the first ``PEAK_GBPS`` row whose pattern matches the device's name, else
        unknown (figures are then given in GB/s alone). Pure; the ``--peak-gbps`` help
        lists the table.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

# Peak memory bandwidth in GB/s by torch.cuda.get_device_name(), first match wins. H100 PCIe
# and NVL and the A100 80GB PCIe card have other figures: they are "unknown" here.
PEAK_GBPS: tuple[tuple[str, str, float], ...] = (
    (r"\bH200\b", "H200", 4800.0),
    (r"\bH100\b(?!.*\b(?:PCIe|NVL)\b)", "H100 SXM", 3350.0),  # "NVIDIA H100 80GB HBM3"
    (r"\bA100\b.*\b80GB\b(?!.*\bPCIe\b)", "A100 80GB", 2039.0),  # "NVIDIA A100-SXM4-80GB"
    (r"\bL40S\b", "L40S", 864.0),
)


@dataclass(frozen=True)
class Peak:
    gbps: float | None
    source: str  # "--peak-gbps", "table: <GPU>" or "unknown"


def peak_bandwidth(device_name: str | None, override: float | None) -> Peak:
    """The peak memory bandwidth to measure against: ``override``, else the table's figure
    for ``device_name``, else unknown."""
    if override is not None:
        return Peak(override, "--peak-gbps")
    for pattern, label, gbps in PEAK_GBPS:
        if device_name and re.search(pattern, device_name):
            return Peak(gbps, f"table: {label}")
    return Peak(None, "unknown")


def cuda_device() -> dict[str, Any] | None:
    """The first CUDA device's facts, or None when torch sees none."""
    import torch

    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(0)
    return {
        "name": torch.cuda.get_device_name(0),
        "capability": f"{props.major}.{props.minor}",
        "memory_gib": round(props.total_memory / 2**30, 1),
        "count": torch.cuda.device_count(),
        "torch_cuda": torch.version.cuda,
    }


def no_cuda_reason() -> str:
    import torch

    built = f"built for CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    hint = f", CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else ""
    return f"torch.cuda.is_available() is False (torch {torch.__version__}, {built}{hint})"
