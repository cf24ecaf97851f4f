"""One Lynx runtime per server process: the settings, the sender (prefill) or receiver
(decode), the speculative decoder and the metrics, built in one place and found by every
hook through :func:`current`.

Upstream builds its KV manager in ``PrefillBootstrapQueue._init_kv_manager`` /
``DecodePreallocQueue._init_kv_manager``; the AROUND hook :func:`build_on_kv_manager`
(registered by :mod:`lynx_patches.disaggregation_prefill` and
:mod:`lynx_patches.disaggregation_decode`) then binds Lynx to the KV pool, builds the
runtime, hands it to the manager and installs it. Without ``--lynx`` nothing is built and
:func:`current` is None, which every hook reads as "behave as upstream".

Contract of :func:`build_on_kv_manager`: scheduler thread, once per scheduler process,
before the first request; it may raise :class:`LynxConfigError`, which stops the server
at start-up with the reason.
"""

from __future__ import annotations

import abc
import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from lynx import codec
from lynx.first_token import StreamedAhead
from lynx.lanes import LaneConfig
from lynx.lanes.mooncake import MooncakeBackend
from lynx.metrics import LynxMetrics
from lynx.settings import LynxSettings, LynxSettingsError
from lynx.speculative import SpeculativeDecoder
from lynx.transfer import Handshake, ProgressiveReceiver, ProgressiveSender, RoomReport
from lynx.transfer.protocol import bytes_per_token
from lynx_patches import upstream
from lynx_patches.decode_engine import SGLangDecodeEngine
from lynx_patches.errors import LynxConfigError

logger = logging.getLogger(__name__)


# The start-up log's words for ``codec.warm_up``'s answer.
CODEC_NAMES = {
    "triton": "Triton kernels",
    "cpp": "C++ (compiled)",
    "reference": "torch reference (slow)",
}


@dataclass
class LynxRuntime:
    settings: LynxSettings
    handshake: Handshake
    page_size: int
    codec_backend: codec.CodecBackend  # what encodes/decodes this server's pool: triton, cpp, reference
    # Attention-TP ranks this server's KV heads are split over; each rank runs its own
    # runtime for its own heads and pairs with the peer rank of the same index.
    tp_ranks: int = 1
    # The model layer of the pool's first layer (pipeline stages hold a slice of the model).
    kv_start_layer: int = 0
    sender: ProgressiveSender | None = None  # prefill
    receiver: ProgressiveReceiver | None = None  # decode
    decoder: SpeculativeDecoder | None = None  # decode, speculative mode
    metrics: LynxMetrics | None = None  # decode, --enable-metrics
    # decode: requests whose first token streamed before they joined a batch
    streamed_ahead: StreamedAhead = field(default_factory=StreamedAhead)

    def stats(self) -> dict[str, Any]:
        """``/server_info``'s ``lynx_transfer``: buffer use, requests in flight, bytes moved,
        and what speculation did."""
        side = self.sender or self.receiver
        stats = {} if side is None else vars(side.stats())
        if self.decoder is not None:
            spec = self.decoder.stats
            stats["speculation"] = {
                **vars(spec),
                "acceptance_rate": spec.acceptance_rate,
                "agreement_rate": spec.agreement_rate,
            }
        return stats

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()


class LynxManagerRole(abc.ABC):
    """A KV manager built for ``--lynx``
    (:class:`lynx_patches.mooncake_connector.LynxKVManager`): what
    :func:`build_on_kv_manager` binds this process's runtime to. Declared here, not in the
    connector, so the hooks can name the type without importing SGLang's Mooncake classes."""

    lynx_settings: LynxSettings

    @abc.abstractmethod
    def lynx_attach(self, runtime: LynxRuntime) -> None:
        """Take ``runtime`` (scheduler thread, right after construction)."""


class LynxReceiverRole(abc.ABC):
    """A KV receiver built for ``--lynx``
    (:class:`lynx_patches.mooncake_connector.LynxKVReceiver`): what decode's commit hook
    (``disaggregation_decode``) reads of a request's transfer once upstream commits it."""

    lynx_slots: torch.Tensor | None  # the request's KV slots, in token order
    lynx_report: RoomReport | None  # what its transfer cost, once released after decoding
    # upstream's aux data (prefill's first token) landed while Lynx's KV is still on the way
    lynx_aux_landed: bool
    # the first token went into the request ahead of its KV (disaggregation_decode), so
    # upstream's commit of the transfer must not append it again
    lynx_first_token_committed: bool

    @property
    @abc.abstractmethod
    def lynx_speculating(self) -> bool:
        """Its Anchor is in the KV and the room is kept for the speculative decoder."""

    @abc.abstractmethod
    def lynx_end_speculation(self) -> None:
        """The request ended at commit: give its room up, nobody will verify it."""


_current: LynxRuntime | None = None


def current() -> LynxRuntime | None:
    """This process's runtime; None without ``--lynx`` (or before the KV manager exists)."""
    return _current


def speculative_decoder() -> SpeculativeDecoder | None:
    """This process's speculative decoder (a decode server in speculative mode), or None."""
    return None if _current is None else _current.decoder


def install(runtime: LynxRuntime | None) -> None:
    """Make ``runtime`` this process's (None: uninstall). Called by :func:`build_on_kv_manager`;
    tests call it to run hooks against a runtime of their own."""
    global _current
    _current = runtime


def _buffer_bytes(pool_rows: int, handshake: Handshake, requested: int) -> int:
    if requested:
        return requested
    anchor, residual = bytes_per_token(handshake.layout, handshake.codec)
    # Every KV row of the pool may be in flight at once; 1 MiB for per-request alignment.
    return math.ceil(pool_rows * (anchor + residual)) + (1 << 20)


def _notify(manager: Any, endpoint: tuple[str, int], frames: list[bytes]) -> None:
    try:
        upstream.send_to_peer(manager, endpoint, frames)
    except Exception as exc:  # a dead decode server: its requests fail on its side
        logger.warning("Lynx: notice to %s:%s not sent: %s", *endpoint, exc)


def build(
    manager: Any, pool: Any, settings: LynxSettings, *, seed: int | None = None, overlap: bool = False
) -> LynxRuntime:
    """Bind Lynx to ``manager`` (a ``LynxKVManager``) and its server's KV ``pool``. Decode:
    ``seed`` is the scheduler's (for the acceptance rule's coin flips), ``overlap`` whether
    it runs the overlap loop."""
    if upstream.manager_is_mla(manager):
        raise LynxConfigError("--lynx supports MHA/GQA KV pools, not MLA models")
    k, v = upstream.kv_pool_buffers(pool)
    try:
        layout = codec.kv_layout_of(k, v)
        handshake = Handshake(
            settings.mode,
            settings.codec_config(),
            layout,
            settings.protect_first,
            settings.protect_last,
            settings.checksums,
        )
        bytes_per_token(layout, handshake.codec)  # checks group_size against head_dim
    except codec.CodecError as exc:
        raise LynxConfigError(f"--lynx cannot encode this KV pool: {exc}") from exc
    try:
        auth = settings.auth_key()  # read here, in this process: the key is never in the settings
    except LynxSettingsError as exc:
        raise LynxConfigError(str(exc)) from None
    handshake = handshake.signed_with(auth)
    codec_backend = codec.warm_up(k[0].device)  # load the native codec now, not on the first request
    nbytes = _buffer_bytes(k[0].shape[0], handshake, settings.buffer_bytes)
    buffer = torch.empty(nbytes, dtype=torch.uint8, device=k[0].device)
    page_size = upstream.manager_page_size(manager)
    runtime = LynxRuntime(
        settings,
        handshake,
        page_size,
        codec_backend,
        upstream.manager_attn_tp_size(manager),
        upstream.kv_pool_start_layer(pool),
    )
    if upstream.manager_is_prefill(manager):
        engine, session_id = upstream.manager_transfer_engine(manager)
        runtime.sender = ProgressiveSender(
            backend=MooncakeBackend.attach(engine, session_id),
            buffer=buffer,
            k_buffers=k,
            v_buffers=v,
            page_size=page_size,
            handshake=handshake,
            lane_config=LaneConfig(
                low_chunk_bytes=settings.lane_chunk_bytes,
                deadline_s=settings.transfer_deadline_s,
            ),
            notify=lambda endpoint, frames: _notify(manager, endpoint, frames),
            on_failure=lambda room, reason: upstream.fail_room(manager, room, f"Lynx: {reason}"),
            hold_s=(settings.anchor_hold_s, settings.residual_hold_s),
            auth=auth,
            layerwise_from=settings.layerwise_from,
        )
    else:
        if upstream.metrics_enabled(manager):
            runtime.metrics = LynxMetrics({"engine_rank": str(upstream.manager_engine_rank(manager))})
        upstream.register_receive_buffer(manager, buffer.data_ptr(), nbytes)
        runtime.receiver = ProgressiveReceiver(
            buffer=buffer,
            k_buffers=k,
            v_buffers=v,
            handshake=handshake,
            deadline_s=settings.transfer_deadline_s,
            on_dropped=None if runtime.metrics is None else runtime.metrics.dropped_notice,
            auth=auth,
        )
        if settings.mode.verifies:
            runtime.decoder = SpeculativeDecoder(
                SGLangDecodeEngine(),
                runtime.receiver,
                settings.max_speculative_tokens,
                page_size,
                runtime.metrics,
                tolerance=settings.verify_tolerance,
                verify_pass=settings.verify_pass,
                draft_memory_bytes=settings.draft_memory_bytes,
                seed=seed,
                overlap=overlap,
                streamed_ahead=runtime.streamed_ahead,
            )
    # Where this side hears its peer's control messages (offers on prefill, notices on
    # decode): what to firewall, and what a drill aims forged messages at.
    logger.info(
        "Lynx %s side ready: %s; codec %s; %s buffer %.1f MiB; %s on %s",
        "prefill" if runtime.sender else "decode",
        handshake.describe(),
        CODEC_NAMES[codec_backend],
        "send" if runtime.sender else "receive",
        nbytes / (1 << 20),
        "offers" if runtime.sender else "notices",
        upstream.control_endpoint(manager),
    )
    return runtime


def build_on_kv_manager(original: Any, queue: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``{Prefill,Decode}...Queue._init_kv_manager``: upstream builds the manager
    (Lynx's with ``--lynx``), then Lynx binds to the queue's KV pool."""
    manager = original(queue, *args, **kwargs)
    if isinstance(manager, LynxManagerRole):
        pool = upstream.queue_kv_pool(queue)
        if upstream.manager_is_prefill(manager):
            runtime = build(manager, pool, manager.lynx_settings)
        else:
            scheduler = upstream.queue_scheduler(queue)
            runtime = build(
                manager,
                pool,
                manager.lynx_settings,
                seed=upstream.random_seed(scheduler),
                overlap=upstream.overlaps(scheduler),
            )
        manager.lynx_attach(runtime)
        install(runtime)
    return manager
