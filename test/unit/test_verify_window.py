"""The speculation window (``lynx.verify.window``)."""

from __future__ import annotations

import pytest

from lynx.verify import WindowEstimator, speculation_window
from lynx.verify.window import MIN_WINDOW, SLACK, RecentLine


def window(verify_pass: str = "layers", **kwargs: object) -> int:
    args: dict[str, object] = {"max_tokens": 256, "flight_s": 2.0, "step_s": 0.1, "agreement": None}
    return speculation_window(verify_pass=verify_pass, **{**args, **kwargs})  # type: ignore[arg-type]


def test_without_measurements_the_window_is_the_maximum() -> None:
    for verify_pass in ("layers", "steps", "batched"):
        assert window(verify_pass, max_tokens=64, flight_s=None) == 64
        assert window(verify_pass, max_tokens=64, step_s=None) == 64


def test_the_window_follows_how_the_verify_pass_pays_for_a_draft() -> None:
    """2 s in flight at 0.1 s a step: 20 tokens could be decoded before the landing."""
    # layers: 10 drafted and their 10 rows verified while the Residual lands
    assert window("layers") == 10
    # steps: the pass decodes each held token again, so only those decoded in the flight are free
    assert window("steps") == 20
    # batched: one forward verifies them all, so decode past the landing rather than stall
    assert window("batched") == SLACK * 20 + MIN_WINDOW
    assert window("batched", max_tokens=16) == 16


def test_a_residual_expected_within_a_decode_step_or_two_gets_no_draft() -> None:
    """A short prompt on a fast link: the Residual lands 0.13 s after the Anchor and a step
    takes 0.065 s. A draft there would only delay the tokens after it (the verify pass
    computes it again once the Residual landed), so the request waits for it."""
    assert window("layers", flight_s=0.13, step_s=0.065) == 1
    assert window("layers", flight_s=0.12, step_s=0.065) == 0
    assert window("steps", flight_s=0.06, step_s=0.065) == 0
    assert window("layers", flight_s=0.0) == 0
    assert window("batched", flight_s=0.0) == MIN_WINDOW  # one forward verifies what it drafted


def test_the_window_stops_where_acceptance_makes_drafts_worthless() -> None:
    # agreement 0.9: 0.9 ** n < 0.02 from n = 38 on.
    assert window("batched", flight_s=1e6, agreement=0.9) == 38
    assert window("layers", flight_s=1e6, agreement=0.1) == MIN_WINDOW  # a few drafts always
    assert window("layers", flight_s=1e6, agreement=0.1, max_tokens=2) == 2
    assert window("layers", flight_s=0.1, agreement=0.1) == 0  # unless none pays at all


def test_bad_input_raises() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        window(max_tokens=0)
    with pytest.raises(ValueError, match="verify_pass must be one of layers, steps, batched"):
        window("fast")


def test_a_line_tells_the_fixed_part_from_the_part_that_grows() -> None:
    line = RecentLine("proportional")
    assert line.predict(100) is None
    line.observe(1_000, 0.2)
    # one length: a flight is taken as bytes over the link
    assert line.predict(2_000) == pytest.approx(0.4)
    line.observe(1_100, 0.21)
    assert line.predict(2_000) == pytest.approx(0.205 / 1_050 * 2_000)  # 1.1x apart: still one length
    line.observe(10_000, 1.1)  # 0.1 s fixed + 10 kB/s
    line.observe(1_000, 0.2)
    assert line.predict(5_000) == pytest.approx(0.6)
    assert line.predict(0) == pytest.approx(0.1)


def test_a_line_stays_non_negative_and_follows_the_latest_measurements() -> None:
    step = RecentLine("constant", size=3)
    step.observe(256, 0.06)
    assert step.predict(2048) == pytest.approx(0.06)  # one length: a step is mostly weights
    step.observe(2048, 0.04)  # longer came faster (noise): their mean, not a falling line
    assert step.predict(4096) == pytest.approx(0.05)
    flight = RecentLine("proportional")
    flight.observe(1_000, 0.01)
    flight.observe(10_000, 1.0)  # the fit's intercept would be negative: through the origin
    through_origin = (1_000 * 0.01 + 10_000 * 1.0) / (1_000**2 + 10_000**2)
    assert flight.predict(10_000) == pytest.approx(10_000 * through_origin)
    for x in (4096, 4096, 4096):
        step.observe(x, 0.12)
    assert step.predict(256) == pytest.approx(0.12)  # the oldest three are gone
    with pytest.raises(ValueError, match="finite"):
        step.observe(1, float("nan"))
    with pytest.raises(ValueError, match="finite"):
        step.observe(-1, 0.1)


def test_the_estimator_fits_flights_and_steps_by_length() -> None:
    """After a warm-up of short prompts, a long one's step is not the short ones' (nor a
    multiple of it), and a short one's flight is not a long one's share of it."""
    est = WindowEstimator()
    assert est.expected_flight_s(10_000) is None and est.expected_step_s(2048) is None
    est.observe_decoding(10, 0.6, prompt_tokens=256)
    est.observe_decoding(0, 1.0, prompt_tokens=256)  # nothing held: no measurement
    assert est.expected_step_s(2048) == pytest.approx(0.06)
    est.observe_decoding(10, 1.25, prompt_tokens=2048)
    assert est.expected_step_s(4096) == pytest.approx(0.06 + (0.125 - 0.06) * (4096 - 256) / (2048 - 256))
    est.observe_residual(13_000_000, 0.17)  # unshaped: mostly the fixed part
    est.observe_residual(1_000_000, 0.0)  # landed with the Anchor: no measurement
    assert est.expected_flight_s(1_300_000) == pytest.approx(0.017)  # one length: a tenth of the bytes
    est.observe_residual(1_300_000, 0.13)
    assert est.expected_flight_s(1_300_000) == pytest.approx(0.13)
    assert est.expected_flight_s(26_000_000) == pytest.approx(0.13 + 0.04 * (26 - 1.3) / (13 - 1.3))


def test_a_lossless_residual_is_expected_to_send_what_residuals_have_sent() -> None:
    """A lossless Residual travels shorter than its space: the window sizes its flight from
    the share of their space that landed Residuals took, the whole space before any."""
    est = WindowEstimator(weight=0.5)
    est.observe_residual(4000, 2.0, space=10_000)
    assert est.expected_flight_s(10_000) == pytest.approx(2.0 * 10_000 * 0.4 / 4000)
    est.observe_residual(6000, 3.0, space=10_000)
    assert est.residual_fill == 0.5
    assert est.expected_flight_s(10_000) == pytest.approx(2.5)  # 5000 bytes on the line
    est.observe_residual(0, 0.0, space=10_000)  # nothing landed: no measurement
    assert est.residual_fill == 0.5
