"""LynxMetrics: the dropped-notice counter, labelled by reason."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prometheus_client import REGISTRY

from lynx.metrics import LynxMetrics


@pytest.fixture
def metrics() -> Iterator[LynxMetrics]:
    before = set(REGISTRY._collector_to_names)
    yield LynxMetrics({"engine_rank": "0"})
    for collector in set(REGISTRY._collector_to_names) - before:  # metric names are process-wide
        REGISTRY.unregister(collector)


def test_dropped_notices_are_counted_by_reason(metrics: LynxMetrics) -> None:
    metrics.dropped_notice("unknown_reservation")
    metrics.dropped_notice("unknown_reservation")
    metrics.dropped_notice("malformed")

    def count(reason: str) -> float | None:
        labels = {"engine_rank": "0", "reason": reason}
        return REGISTRY.get_sample_value("lynx_dropped_notices_total", labels)

    assert (count("unknown_reservation"), count("malformed")) == (2.0, 1.0)
