"""What speculation did on one decode server: counters for ``/server_info``, Prometheus
and the closing report of each request."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpeculationReport:
    """One request's speculation, reported in its ``meta_info["lynx_transfer"]``."""

    held: int  # tokens decoded on Anchor KV and held back
    accepted: int  # of those, committed after verification
    agreed: int | None  # greedy: held tokens equal to the full-precision argmax at their position
    rejected: bool  # a held token was wrong: the rest was rolled back, one token corrected
    park_reason: str | None
    anchor_to_commit_s: float  # first decode on the Anchor -> tokens committed
    verify_s: float  # the verify forward this request was part of


@dataclass
class SpeculationStats:
    requests: int = 0  # requests decoded on the Anchor while their Residual was in flight
    waited: int = 0  # requests that waited for the Residual (sampling settings Lynx cannot verify)
    held_tokens: int = 0
    accepted_tokens: int = 0
    greedy_held_tokens: int = 0
    agreed_tokens: int = 0  # greedy held tokens equal to the full-precision argmax (teacher-forced)
    rejections: int = 0  # requests with at least one rejected held token
    verify_passes: int = 0
    verify_seconds: float = 0.0
    failed: int = 0  # Residual never landed, or the request was aborted while speculative
    active: int = 0  # requests speculating or parked right now

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.held_tokens if self.held_tokens else None

    @property
    def agreement_rate(self) -> float | None:
        return self.agreed_tokens / self.greedy_held_tokens if self.greedy_held_tokens else None

    def record(self, report: SpeculationReport) -> None:
        self.held_tokens += report.held
        self.accepted_tokens += report.accepted
        self.rejections += report.rejected
        if report.agreed is not None:
            self.greedy_held_tokens += report.held
            self.agreed_tokens += report.agreed
