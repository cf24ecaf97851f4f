"""CPU-engine fix for tensor parallelism: no PyNccl communicator for CPU groups.

Hook target (``sglang.srt.`` omitted; registered on the CPU engine only):
* ``distributed.parallel_state.init_model_parallel_group`` AROUND: always
  ``use_pynccl=False``.  Upstream's platform default enables PyNccl on every platform that
  is neither NPU, XPU nor Mooncake's backend (and some callers ask for it), and building
  the communicator on the CPU engine fails with "Expected a cuda device, but got: cpu";
  the groups' gloo ``cpu_group`` carries every collective there.
"""

from __future__ import annotations

from typing import Any

from lynx_patches._hooks import hook

TARGET = "distributed.parallel_state.init_model_parallel_group"


def _gloo_only(original: Any, *args: Any, **kwargs: Any) -> Any:
    if len(args) > 3:
        args = (*args[:3], False, *args[4:])
    else:
        kwargs["use_pynccl"] = False
    return original(*args, **kwargs)


def register() -> None:
    hook(TARGET, _gloo_only, "around")
