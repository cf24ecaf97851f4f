"""Lynx's Prometheus metrics (``--enable-metrics``), decode side: they observe the
transfer of each request (:class:`lynx.transfer.RoomReport`) and what speculation did with
it (:class:`lynx.verify.SpeculationReport`), so they belong to neither.

Created in the scheduler process after the server set up Prometheus' multi-process
directory, so the server's ``/metrics`` endpoint collects them with its own.
"""

from __future__ import annotations

from lynx.transfer import RoomReport
from lynx.verify import SpeculationReport

_BYTE_BUCKETS = tuple(float(1 << n) for n in range(12, 34, 2))  # 4 KiB .. 8 GiB
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class LynxMetrics:
    def __init__(self, labels: dict[str, str]) -> None:
        from prometheus_client import Counter, Histogram  # after PROMETHEUS_MULTIPROC_DIR is set

        names = sorted(labels)
        self._labels = labels

        def histogram(name: str, text: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, text, labelnames=names, buckets=buckets)

        self.anchor_bytes = histogram("lynx_anchor_bytes", "Anchor bytes received per request", _BYTE_BUCKETS)
        self.residual_bytes = histogram(
            "lynx_residual_bytes", "Residual bytes received per request", _BYTE_BUCKETS
        )
        self.anchor_latency = histogram(
            "lynx_anchor_latency_seconds", "Receive space offered -> Anchor landed", _LATENCY_BUCKETS
        )
        self.residual_latency = histogram(
            "lynx_residual_latency_seconds", "Receive space offered -> Residual landed", _LATENCY_BUCKETS
        )
        self.failures = Counter("lynx_transfer_failures", "Requests whose Lynx transfer failed", names)
        self.dropped = Counter(
            "lynx_dropped_notices",
            "Prefill notices dropped (reason): malformed, oversized, unsigned, bad_signature, "
            "unknown_reservation",
            [*names, "reason"],
        )
        self.held = Counter("lynx_held_tokens", "Tokens decoded on Anchor KV and held back", names)
        self.accepted = Counter("lynx_accepted_tokens", "Held tokens committed after verification", names)
        self.verify_latency = histogram(
            "lynx_verify_seconds", "Verify forward (refined KV) per request", _LATENCY_BUCKETS
        )
        self.anchor_to_commit = histogram(
            "lynx_anchor_to_commit_seconds",
            "Decoding on the Anchor -> held tokens committed",
            _LATENCY_BUCKETS,
        )

    def observe(self, report: RoomReport) -> None:
        labels = self._labels
        self.anchor_bytes.labels(**labels).observe(report.anchor_bytes)
        self.residual_bytes.labels(**labels).observe(report.residual_bytes)
        if report.anchor_latency_s is not None:
            self.anchor_latency.labels(**labels).observe(report.anchor_latency_s)
        if report.residual_latency_s is not None:
            self.residual_latency.labels(**labels).observe(report.residual_latency_s)

    def speculated(self, report: SpeculationReport) -> None:
        labels = self._labels
        self.held.labels(**labels).inc(report.held)
        self.accepted.labels(**labels).inc(report.accepted)
        self.verify_latency.labels(**labels).observe(report.verify_s)
        self.anchor_to_commit.labels(**labels).observe(report.anchor_to_commit_s)

    def failed(self) -> None:
        self.failures.labels(**self._labels).inc()

    def dropped_notice(self, reason: str) -> None:
        self.dropped.labels(**self._labels, reason=reason).inc()
