"""Priority transfer lanes: Anchor bytes first, Residual bytes in the gaps.

`LaneScheduler` drives any `TransferBackend`; `MooncakeBackend` (imported lazily, it needs
the Mooncake Transfer Engine) is the real one.
"""

from lynx.lanes.backend import BatchState, Transfer, TransferBackend, TransferBackendError
from lynx.lanes.ranges import AddressError, AddressRanges
from lynx.lanes.scheduler import LaneScheduler
from lynx.lanes.stats import LaneStats, Percentiles, SchedulerStats
from lynx.lanes.streams import (
    STREAM_TRANSITIONS,
    Lane,
    LaneConfig,
    LaneError,
    StreamClosedError,
    StreamState,
    StreamStatus,
)

__all__ = [
    "STREAM_TRANSITIONS",
    "AddressError",
    "AddressRanges",
    "BatchState",
    "Lane",
    "LaneConfig",
    "LaneError",
    "LaneScheduler",
    "LaneStats",
    "Percentiles",
    "SchedulerStats",
    "StreamClosedError",
    "StreamState",
    "StreamStatus",
    "Transfer",
    "TransferBackend",
    "TransferBackendError",
]
