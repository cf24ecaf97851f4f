"""``/server_info``'s Lynx keys as the internal-state hook (``lynx_patches.internal_state``)
adds them to a scheduler's internal state: the settings, which codec runs, the transfer
counters and the free KV tokens; only the settings key (None) without ``--lynx``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lynx.settings import SETTINGS_ENV, LynxSettings
from lynx_patches import internal_state, runtime


def _controller(free_tokens: int) -> SimpleNamespace:
    allocator = SimpleNamespace(available_size=lambda: free_tokens)
    return SimpleNamespace(scheduler=SimpleNamespace(token_to_kv_pool_allocator=allocator))


@pytest.mark.parametrize("codec_backend", ["cpp", "reference", "triton"])
def test_server_info_names_the_codec_that_runs(monkeypatch, codec_backend) -> None:
    settings = LynxSettings()
    monkeypatch.setenv(SETTINGS_ENV, settings.to_json())
    runtime.install(runtime.LynxRuntime(settings, handshake=None, page_size=1, codec_backend=codec_backend))
    try:
        state = internal_state._add_lynx(SimpleNamespace(internal_state={}), _controller(7)).internal_state
    finally:
        runtime.install(None)
    assert state["lynx_codec_backend"] == codec_backend
    assert state["lynx"]["mode"] == settings.mode
    assert state["lynx_transfer"] == {} and state["lynx_kv_available_tokens"] == 7


def test_without_lynx_only_the_settings_key_is_added(monkeypatch) -> None:
    monkeypatch.delenv(SETTINGS_ENV, raising=False)
    state = internal_state._add_lynx(SimpleNamespace(internal_state={}), _controller(7)).internal_state
    assert state == {"lynx": None}
