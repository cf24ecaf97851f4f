"""How many tokens a request should hold before its Residual lands: the speculation
window.

A held token is decoded again, in effect, by the verify pass: what a draft can win is
set by when that pass runs (``--lynx-verify-pass``, as the decode server runs it):

* ``layers`` (the held rows run through each layer as its Residual lands): a draft costs
  a decode step to decode and about one to verify, and both fit in the Residual's flight;
  the tokens then commit as it lands instead of a verify pass later. So the window is
  *half* the tokens the request can decode in the flight;
* ``steps`` (one decode step per held row once the Residual landed): the pass decodes
  each held token again, so a draft wins nothing for later tokens. One decoded in the
  flight costs nothing either (the request would wait for the Residual anyway); one
  decoded past the landing delays every later token by a step. So the window is the
  tokens the request can decode in the flight, no more;
* ``batched`` (every held row in one forward, a few decode steps whatever their number):
  drafts past the landing cost little, a stall costs the drafts it did not decode, so the
  flight's tokens with slack and a floor.

A window of 0 is a decision too: the Residual is expected before a draft would pay, so
the request streams its first token (the Anchor's gain) and waits for the Residual
without drafting, as ``full`` mode decodes from then on. Short prompts on a fast link
land their Residual a fraction of a decode step after the Anchor: any draft there only
delays them.

The window is also at most the tokens worth drafting (a prefix of ``n`` held tokens is
accepted whole with probability about ``agreement ** n``; past the length where that
falls below ``min_prefix_probability`` more tokens are almost surely rolled back; at
least ``MIN_WINDOW``) and ``max_tokens`` (``--lynx-max-speculative-tokens``). Without
measurements yet (the first requests of a server) it is ``max_tokens``.

:class:`WindowEstimator` keeps the measurements. Neither a flight nor a decode step is
proportional to one number: a Residual's flight is a fixed part (its last layers'
encode, notices, the refine) plus its bytes over the link, a decode step a fixed part
(the weights) plus attention over the context. A server sees prompts of many lengths
(its warm-up's are short), so each is a line fitted over the latest measurements
(:class:`RecentLine`), not one moving average.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Literal

MIN_WINDOW = 4  # batched, and the agreement bound: the first drafts are the likeliest accepted
SLACK = 1.5  # batched: decode a little past the expected landing, a stall costs more than drafts

VerifyPass = Literal["layers", "steps", "batched"]
VERIFY_PASSES: tuple[VerifyPass, ...] = ("layers", "steps", "batched")


def speculation_window(
    *,
    max_tokens: int,
    flight_s: float | None,
    step_s: float | None,
    agreement: float | None,
    verify_pass: VerifyPass,
    min_prefix_probability: float = 0.02,
) -> int:
    """See the module docstring. ``flight_s``: seconds the request's Residual is expected
    to land after its Anchor; ``step_s``: seconds a decode step of this request is
    expected to take; None: not measured yet. ``verify_pass``: the one that will run."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if verify_pass not in VERIFY_PASSES:
        raise ValueError(f"verify_pass must be one of {', '.join(VERIFY_PASSES)}, got {verify_pass!r}")
    window = max_tokens
    if flight_s is not None and step_s is not None and flight_s >= 0 and step_s > 0:
        in_flight = flight_s / step_s  # tokens the request can decode before the landing
        if verify_pass == "layers":
            window = min(window, math.floor(in_flight / 2))
        elif verify_pass == "steps":
            window = min(window, math.floor(in_flight))
        else:
            window = min(window, math.ceil(SLACK * in_flight) + MIN_WINDOW)
    if agreement is not None and 0.0 < agreement < 1.0:
        useful = math.log(min_prefix_probability) / math.log(agreement)
        window = min(window, max(MIN_WINDOW, math.ceil(useful)))
    return max(0, window)


@dataclass
class RecentLine:
    """``y = a + b * x`` (``a, b >= 0``), fitted by least squares over the latest ``size``
    measurements, so that it follows a link or a load that changes.

    Until the measurements span lengths that tell ``a`` from ``b`` (the largest ``x`` at
    least ``SPREAD`` times the smallest), the line is what a single length says:
    ``flat="proportional"``, through the origin (a Residual's flight, mostly bytes over
    the link), or ``flat="constant"``, their mean (a decode step, mostly the weights).
    """

    flat: Literal["proportional", "constant"]
    size: int = 8
    points: deque[tuple[float, float]] = field(init=False)

    SPREAD = 1.5

    def __post_init__(self) -> None:
        self.points = deque(maxlen=self.size)

    def observe(self, x: float, y: float) -> None:
        if x < 0 or y < 0 or not (math.isfinite(x) and math.isfinite(y)):
            raise ValueError(f"a measurement is a finite (x >= 0, y >= 0), got ({x}, {y})")
        self.points.append((x, y))

    def predict(self, x: float) -> float | None:
        """``y`` at ``x``; None before any measurement."""
        if not self.points:
            return None
        xs = [p[0] for p in self.points]
        ys = [p[1] for p in self.points]
        mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
        if max(xs) <= 0 or max(xs) < self.SPREAD * min(xs):
            if self.flat == "constant" or mean_x == 0:
                return mean_y
            return mean_y / mean_x * x
        slope = sum((px - mean_x) * (py - mean_y) for px, py in self.points) / sum(
            (px - mean_x) ** 2 for px in xs
        )
        if slope < 0:  # longer was faster: noise around a constant
            return mean_y
        intercept = mean_y - slope * mean_x
        if intercept < 0:  # no fixed part: the best line through the origin
            return sum(px * py for px, py in self.points) / sum(px * px for px in xs) * x
        return intercept + slope * x


@dataclass
class WindowEstimator:
    """What a decode server has measured to size windows from."""

    weight: float = 0.3  # of the newest fill measurement
    # seconds from a Residual's Anchor landing to its own, against its bytes
    flight: RecentLine = field(default_factory=lambda: RecentLine("proportional"))
    # seconds per held token (admission to the last one held), against the prompt's tokens
    step: RecentLine = field(default_factory=lambda: RecentLine("constant"))
    # landed Residual bytes / the space reserved for them (a lossless Residual codes short)
    residual_fill: float | None = None

    def observe_residual(self, nbytes: int, seconds: float, space: int | None = None) -> None:
        """A Residual of ``nbytes`` (in ``space`` reserved bytes) landed ``seconds`` after
        its Anchor."""
        if nbytes > 0 and seconds > 0:
            self.flight.observe(nbytes, seconds)
        if nbytes > 0 and space:
            new = min(1.0, nbytes / space)
            self.residual_fill = (
                new
                if self.residual_fill is None
                else ((1 - self.weight) * self.residual_fill + self.weight * new)
            )

    def observe_decoding(self, tokens: int, seconds: float, prompt_tokens: int) -> None:
        """A request with a ``prompt_tokens`` prompt held ``tokens`` tokens over ``seconds``."""
        if tokens > 0 and seconds > 0:
            self.step.observe(prompt_tokens, seconds / tokens)

    def expected_flight_s(self, residual_space: int) -> float | None:
        """Seconds a Residual with ``residual_space`` reserved bytes is expected to land
        after its Anchor: the bytes it is expected to send (the share of their space
        landed Residuals took; all of it before any) on the fitted line."""
        fill = 1.0 if self.residual_fill is None else self.residual_fill
        return self.flight.predict(math.ceil(residual_space * fill))

    def expected_step_s(self, prompt_tokens: int) -> float | None:
        """Seconds a decode step of a request with a ``prompt_tokens`` prompt is expected to take."""
        return self.step.predict(prompt_tokens)
