"""Small helpers shared by the hook modules."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

UPSTREAM = "sglang.srt."


def is_cpu_engine() -> bool:
    """Upstream's switch for the CPU platform (``sglang.srt.platforms._is_cpu_available``)."""
    return os.environ.get("SGLANG_USE_CPU_ENGINE", "0") == "1"


def hook(target: str, fn: Callable[..., Any], kind: str) -> None:
    """Register ``fn`` on ``sglang.srt.<target>`` (kind: before, after, around, replace)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(UPSTREAM + target, fn, HookType(kind))
