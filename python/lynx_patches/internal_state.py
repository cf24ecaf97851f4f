"""Report the scheduler's Lynx settings and transfer state in ``GET /server_info``.

Hook targets (``sglang.srt.`` omitted):
* ``managers.scheduler_components.internal_state.SchedulerInternalStateController.get_internal_state``
  AFTER: add ``lynx`` (the settings this scheduler process runs with, or None) and, with
  ``--lynx``, ``lynx_codec_backend`` (what encodes and decodes the KV: ``triton``, ``cpp``
  or ``reference``, the slow torch reference), ``lynx_transfer`` (send/receive buffer use,
  requests in flight, bytes moved, speculation) and ``lynx_kv_available_tokens`` (free KV
  pool tokens: back at its idle value when no request holds pages).

This is how a user (and the tests) can see that the launcher's ``--lynx*`` flags reached
the scheduler subprocess, which parses no command line of its own, which codec runs, and
that a failed transfer left nothing behind.

Contract: scheduler thread, on demand; read-only.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lynx import settings
from lynx_patches import runtime, upstream
from lynx_patches._hooks import hook

TARGET = "managers.scheduler_components.internal_state.SchedulerInternalStateController.get_internal_state"


def _add_lynx(result: Any, controller: Any, *_args: Any, **_kwargs: Any) -> Any:
    current = settings.current()
    state = result.internal_state
    state["lynx"] = None if current is None else dataclasses.asdict(current)
    if current is not None:
        lynx = runtime.current()
        state["lynx_codec_backend"] = lynx.codec_backend if lynx is not None else None
        state["lynx_transfer"] = lynx.stats() if lynx is not None else None
        state["lynx_kv_available_tokens"] = upstream.free_kv_tokens(upstream.controller_scheduler(controller))
    return result


def register() -> None:
    hook(TARGET, _add_lynx, "after")
