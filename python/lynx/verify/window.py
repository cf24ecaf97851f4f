"""How many tokens a request should hold before its Residual lands: the speculation
window.

Holding tokens costs decode compute and KV slots; it pays only for tokens that will be
accepted and that are decoded before the Residual lands (after that the request is
verified anyway). So the window is the smallest of

* the tokens the request can decode before its Residual is expected to land: its
  Residual bytes still in flight over the lane's measured throughput, times the measured
  decode rate, with slack (a late estimate parks the request idle, an early one only
  costs a few drafts). When the verify pass runs while the Residual lands
  (``verify_ahead``, ``--lynx-verify-pass layers``), half of them: a held token costs a
  decode step to draft and about one to verify, and both fit in the flight; the tokens
  then commit as the Residual lands instead of a verify pass later (no slack: a parked
  request is not idle, it verifies);
* the tokens worth drafting: a prefix of ``n`` held tokens is accepted whole with
  probability about ``agreement ** n``; past the length where that falls below
  ``min_prefix_probability`` more tokens are almost surely rolled back;
* ``max_tokens`` (``--lynx-max-speculative-tokens``).

Without measurements yet (the first requests of a server) the window is ``max_tokens``.
:class:`WindowEstimator` keeps the measurements (exponentially weighted means).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MIN_WINDOW = 4  # a few drafts always: the first ones are the likeliest to be accepted
SLACK = 1.5  # decode a little past the expected landing: stalls cost more than drafts


def speculation_window(
    *,
    max_tokens: int,
    residual_bytes: int,
    residual_bytes_per_s: float | None,
    tokens_per_s: float | None,
    agreement: float | None,
    min_prefix_probability: float = 0.02,
    verify_ahead: bool = False,
) -> int:
    """See the module docstring. Rates None: not measured yet."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    window = max_tokens
    if residual_bytes_per_s and tokens_per_s and residual_bytes_per_s > 0 and tokens_per_s > 0:
        flight_s = residual_bytes / residual_bytes_per_s
        share = 0.5 if verify_ahead else SLACK
        window = min(window, math.ceil(share * flight_s * tokens_per_s) + MIN_WINDOW)
    if agreement is not None and 0.0 < agreement < 1.0:
        useful = math.log(min_prefix_probability) / math.log(agreement)
        window = min(window, max(MIN_WINDOW, math.ceil(useful)))
    return max(1, min(window, max_tokens))


@dataclass
class WindowEstimator:
    """Running measurements a decode server sizes windows from."""

    weight: float = 0.3  # of the newest measurement
    residual_bytes_per_s: float | None = None  # Residual throughput once the Anchor landed
    tokens_per_s: float | None = None  # held tokens decoded per second, per request
    # landed Residual bytes / the space reserved for them (a lossless Residual codes short)
    residual_fill: float | None = None

    def observe_residual(self, nbytes: int, seconds: float, space: int | None = None) -> None:
        """A Residual of ``nbytes`` (in ``space`` reserved bytes) landed ``seconds`` after
        its Anchor."""
        if nbytes > 0 and seconds > 0:
            self.residual_bytes_per_s = self._mix(self.residual_bytes_per_s, nbytes / seconds)
        if nbytes > 0 and space:
            self.residual_fill = self._mix(self.residual_fill, min(1.0, nbytes / space))

    def expected_residual_nbytes(self, space: int) -> int:
        """How many bytes a Residual with ``space`` reserved bytes is expected to send."""
        return space if self.residual_fill is None else math.ceil(space * self.residual_fill)

    def observe_decoding(self, tokens: int, seconds: float) -> None:
        """A request held ``tokens`` tokens decoded over ``seconds``."""
        if tokens > 0 and seconds > 0:
            self.tokens_per_s = self._mix(self.tokens_per_s, tokens / seconds)

    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.weight) * old + self.weight * new
