"""The speculation window (``lynx.verify.window``)."""

from __future__ import annotations

import pytest

from lynx.verify import WindowEstimator, speculation_window
from lynx.verify.window import MIN_WINDOW, SLACK


def test_without_measurements_the_window_is_the_maximum() -> None:
    window = speculation_window(
        max_tokens=64, residual_bytes=10**6, residual_bytes_per_s=None, tokens_per_s=None, agreement=None
    )
    assert window == 64


def test_the_window_covers_the_residual_flight_with_slack() -> None:
    # 2 MB at 1 MB/s: 2 s in flight, 10 tokens/s -> 20 tokens, with slack and the floor.
    window = speculation_window(
        max_tokens=256, residual_bytes=2_000_000, residual_bytes_per_s=1e6, tokens_per_s=10.0, agreement=None
    )
    assert window == int(SLACK * 20) + MIN_WINDOW
    assert (
        speculation_window(
            max_tokens=16,
            residual_bytes=2_000_000,
            residual_bytes_per_s=1e6,
            tokens_per_s=10.0,
            agreement=None,
        )
        == 16
    )


def test_with_the_verify_pass_ahead_the_flight_holds_half_as_many_drafts() -> None:
    """2 s in flight at 10 tokens/s: 10 drafted and 10 verified while it lands."""
    window = speculation_window(
        max_tokens=256,
        residual_bytes=2_000_000,
        residual_bytes_per_s=1e6,
        tokens_per_s=10.0,
        agreement=None,
        verify_ahead=True,
    )
    assert window == 10 + MIN_WINDOW


def test_the_window_stops_where_acceptance_makes_drafts_worthless() -> None:
    # agreement 0.9: 0.9 ** n < 0.02 from n = 38 on.
    window = speculation_window(
        max_tokens=256, residual_bytes=10**9, residual_bytes_per_s=1e3, tokens_per_s=100.0, agreement=0.9
    )
    assert window == 38
    poor = speculation_window(
        max_tokens=256, residual_bytes=10**9, residual_bytes_per_s=1e3, tokens_per_s=100.0, agreement=0.1
    )
    assert poor == MIN_WINDOW  # a few drafts always
    assert (
        speculation_window(
            max_tokens=2, residual_bytes=10**9, residual_bytes_per_s=1e3, tokens_per_s=100.0, agreement=0.1
        )
        == 2
    )


def test_an_empty_residual_needs_only_the_floor() -> None:
    assert (
        speculation_window(
            max_tokens=64, residual_bytes=0, residual_bytes_per_s=1e6, tokens_per_s=10.0, agreement=None
        )
        == MIN_WINDOW
    )
    with pytest.raises(ValueError, match="max_tokens"):
        speculation_window(
            max_tokens=0, residual_bytes=0, residual_bytes_per_s=None, tokens_per_s=None, agreement=None
        )


def test_the_estimator_mixes_measurements() -> None:
    est = WindowEstimator(weight=0.5)
    est.observe_residual(1000, 2.0)
    assert est.residual_bytes_per_s == 500
    est.observe_residual(3000, 2.0)
    assert est.residual_bytes_per_s == 1000
    est.observe_decoding(10, 1.0)
    est.observe_decoding(0, 1.0)  # nothing held: no measurement
    est.observe_residual(1000, 0.0)  # landed with the Anchor: no measurement
    assert (est.tokens_per_s, est.residual_bytes_per_s) == (10.0, 1000)


def test_a_lossless_residual_is_expected_to_send_what_residuals_have_sent() -> None:
    """A lossless Residual travels shorter than its space: the window sizes its flight from
    the share of their space that landed Residuals took, the whole space before any."""
    est = WindowEstimator(weight=0.5)
    assert est.expected_residual_nbytes(10_000) == 10_000
    est.observe_residual(4000, 2.0, space=10_000)
    est.observe_residual(6000, 2.0, space=10_000)
    assert est.residual_fill == 0.5
    assert est.expected_residual_nbytes(10_000) == 5000
    est.observe_residual(0, 0.0, space=10_000)  # nothing landed: no measurement
    assert est.residual_fill == 0.5
