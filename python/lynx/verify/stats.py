"""What speculation did on one decode server: counters for ``/server_info``, Prometheus
and the closing report of each request."""

from __future__ import annotations

from dataclasses import dataclass

NEAR_TIE_GAP = 0.125  # log-probability: one bf16 rounding step of a logit around 16-32
# A rejection at most this many BF16 ulps of the best logit below it is a near-tie; where
# the logits are at hand (the verify pass) the gap is judged in ulps, which holds at any
# logit size (NEAR_TIE_GAP is one ulp only for logits of 16-32).
NEAR_TIE_ULPS = 1.0


@dataclass
class SpeculationReport:
    """One request's speculation, reported in its ``meta_info["lynx_transfer"]``."""

    held: int  # tokens decoded on Anchor KV and held back
    window: int  # most tokens it was allowed to hold (lynx.verify.window)
    accepted: int  # of those, committed after verification
    # greedy: of the verified rows, held tokens equal to the full-precision argmax there
    agreed: int | None
    rejected: bool  # a held token was wrong: the rest was rolled back, one token corrected
    rejection_gap: float | None  # greedy: log-probability gap of the rejected token to the best
    park_reason: str | None
    anchor_to_commit_s: float  # first decode on the Anchor -> tokens committed
    verify_s: float  # the verify forward this request was part of
    refine_s: float  # rewriting its prompt KV at full precision
    verified: int = 0  # verify rows computed: up to and including the first rejection
    rejection_gap_ulps: float | None = None  # that gap in BF16 ulps of the best logit
    # --lynx-verify-pass layers: the layers its verify rows went through while its Residual
    # was in flight (layer by layer as it landed), and the time that took
    verified_ahead_layers: int = 0
    verify_ahead_s: float = 0.0


@dataclass
class SpeculationStats:
    requests: int = 0  # requests that decoded a draft on the Anchor while their Residual was in flight
    # requests that waited for the Residual without drafting: a window of 0 (it was expected
    # before a draft would pay), sampling settings Lynx cannot verify, no draft memory left
    waited: int = 0
    held_tokens: int = 0
    accepted_tokens: int = 0
    greedy_verified_rows: int = 0  # verify rows of greedy requests (each stops at a rejection)
    agreed_tokens: int = 0  # of those, held tokens equal to the full-precision argmax (teacher-forced)
    rejections: int = 0  # requests with at least one rejected held token
    # greedy rejections by the rejected token's gap to the best one, in BF16 ulps of the
    # best logit (lynx.verify.acceptance.bf16_ulp)
    rejections_tied: int = 0  # an exact tie (gap 0) the argmax broke the other way
    rejections_near_tie: int = 0  # 0 < gap <= 1 ulp: BF16 logits cannot tell them apart
    rejections_far: int = 0  # more than 1 ulp
    verify_passes: int = 0
    verify_seconds: float = 0.0  # verify forwards
    verify_ahead_seconds: float = 0.0  # verify rows run layer by layer while Residuals landed
    refine_seconds: float = 0.0  # prompt KV rewritten at full precision
    commit_seconds: float = 0.0  # decisions, rollbacks, hand-backs
    failed: int = 0  # Residual never landed, the request was aborted while speculative, or its
    # held tokens could not be verified (a bad draft fails its own request only)
    active: int = 0  # requests speculating or parked right now
    rolled_back: int = 0  # rolled back to t_0 because upstream retracted them (pause_generation)
    draft_bytes: int = 0  # device memory held by draft distributions of sampled held tokens now
    draft_bytes_peak: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.held_tokens if self.held_tokens else None

    @property
    def agreement_rate(self) -> float | None:
        return self.agreed_tokens / self.greedy_verified_rows if self.greedy_verified_rows else None

    def record(self, report: SpeculationReport) -> None:
        self.held_tokens += report.held
        self.accepted_tokens += report.accepted
        self.rejections += report.rejected
        gap = report.rejection_gap_ulps
        if gap is not None:
            if gap == 0.0:
                self.rejections_tied += 1
            elif gap <= NEAR_TIE_ULPS:
                self.rejections_near_tie += 1
            else:
                self.rejections_far += 1
        if report.agreed is not None:
            self.greedy_verified_rows += report.verified
            self.agreed_tokens += report.agreed
