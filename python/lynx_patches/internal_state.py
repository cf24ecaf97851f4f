"""Report the scheduler's Lynx settings in ``GET /server_info`` (``internal_states``).

Hook targets (``sglang.srt.`` omitted):
* ``managers.scheduler_components.internal_state.SchedulerInternalStateController.get_internal_state``
  AFTER: add ``lynx`` (the settings this scheduler process runs with, or None).

This is how a user (and the tests) can see that the launcher's ``--lynx*`` flags reached
the scheduler subprocess, which parses no command line of its own.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lynx import settings
from lynx_patches._hooks import hook

TARGET = "managers.scheduler_components.internal_state.SchedulerInternalStateController.get_internal_state"


def _add_lynx(result: Any, *_args: Any, **_kwargs: Any) -> Any:
    current = settings.current()
    result.internal_state["lynx"] = None if current is None else dataclasses.asdict(current)
    return result


def register() -> None:
    hook(TARGET, _add_lynx, "after")
