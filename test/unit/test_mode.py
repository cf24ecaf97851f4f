"""What each mode means, and what RequestLayout says each side sends in it."""

from __future__ import annotations

import pytest
import torch

from lynx.codec import CodecConfig, KVLayout
from lynx.mode import Mode
from lynx.settings import LynxSettings, LynxSettingsError
from lynx.transfer import Handshake, RequestLayout, Stream

LAYOUT = KVLayout(2, 2, 64, torch.bfloat16)


@pytest.mark.parametrize(
    ("mode", "sends_residual", "starts_on_anchor", "verifies"),
    [
        (Mode.FULL, True, False, False),
        (Mode.ANCHOR_ONLY, False, True, False),
        (Mode.SPECULATIVE, True, True, True),
    ],
)
def test_behaviour_of_each_mode(
    mode: Mode, sends_residual: bool, starts_on_anchor: bool, verifies: bool
) -> None:
    assert (mode.sends_residual, mode.starts_on_anchor, mode.verifies) == (
        sends_residual,
        starts_on_anchor,
        verifies,
    )


def test_modes_are_named_by_their_flag_value() -> None:
    assert [m.value for m in Mode] == ["full", "anchor-only", "speculative"]
    assert Mode.parse("anchor-only") is Mode.ANCHOR_ONLY
    assert str(Mode.SPECULATIVE) == "speculative"
    with pytest.raises(ValueError, match="--lynx-mode must be one of full, anchor-only, speculative"):
        Mode.parse("fast")


def test_settings_carry_the_mode_as_a_type_and_json_as_its_name() -> None:
    settings = LynxSettings(mode="speculative")  # type: ignore[arg-type]  # as the flag parser gives it
    assert settings.mode is Mode.SPECULATIVE
    assert '"mode": "speculative"' in settings.to_json()
    assert LynxSettings.from_json(settings.to_json()) == settings
    with pytest.raises(LynxSettingsError, match="--lynx-mode must be one of"):
        LynxSettings(mode="fast")  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", list(Mode))
def test_request_layout_says_what_travels(mode: Mode) -> None:
    plan = RequestLayout.of(Handshake(mode, CodecConfig(), LAYOUT), 300)
    assert plan.encoded_nbytes == plan.anchor_nbytes + plan.residual_nbytes
    if mode.sends_residual:
        assert plan.streams == (Stream.ANCHOR, Stream.RESIDUAL)
        assert plan.sent_residual_nbytes == plan.residual_nbytes > 0
    else:
        assert plan.streams == (Stream.ANCHOR,)
        assert plan.sent_residual_nbytes == 0
    assert plan.receive_nbytes == plan.anchor_nbytes + plan.sent_residual_nbytes
