"""The receive state machine: what decode has heard about one request's Lynx transfer,
and when its landed bytes may be written into the KV pool.

Upstream's receiver reports ``Success`` once prefill's aux data (the first output token)
has landed. With Lynx that is not enough: the KV arrives on Lynx's own lanes, and the
request is ready only once the bytes its mode needs have landed. ``ReceiveTracker`` holds
what decode has heard about the request; :meth:`ReceiveTracker.verdict` combines it with
upstream's status into the one answer the scheduler's poll needs.

States (``RECEIVE_TRANSITIONS`` is the whole machine, pinned by a test)::

    WAITING_SPACE -> OFFERED -> ACCEPTED -> ANCHOR_READY -> COMPLETE
          \\______________\\___________\\____________\\--> FAILED

``WAITING_SPACE``: no receive space free yet, the metadata message is held back (the
request waits, it does not fail). ``OFFERED``: metadata and offer are out. ``ACCEPTED``:
prefill agreed on the settings. ``ANCHOR_READY``/``COMPLETE``: the Anchor / every stream
the request's transfer sends (``RequestLayout.streams``) landed: prefill reported exactly
the bytes the request's layout puts on the stream (at most those on a stream of
variable-length Residuals, whose exact count decode checks as it decodes), with one
checksum per segment when
the handshake says so (none otherwise). A
request is READY (its bytes go into the KV pool) once upstream says ``Success`` and it
reached ``ANCHOR_READY`` (modes that start on the Anchor) or ``COMPLETE`` (``full``).
Before the Residual stream lands, ``LAYERS`` notices say how many of its first layers
have (:attr:`ReceiveTracker.residual_layers`), so that they can be refined meanwhile.

The tracker trusts that the notices it is given are this reservation's (the receiver
drops any other); it checks what they say against the request's layout.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from lynx.transfer.protocol import (
    Handshake,
    Notice,
    NoticeKind,
    ProtocolError,
    RequestLayout,
    Stream,
    parse_handshake,
)
from lynx.verdict import Verdict


class ReceiveState(enum.Enum):
    WAITING_SPACE = "waiting_space"
    OFFERED = "offered"
    ACCEPTED = "accepted"
    ANCHOR_READY = "anchor_ready"
    COMPLETE = "complete"
    FAILED = "failed"


RECEIVE_TRANSITIONS: dict[ReceiveState, frozenset[ReceiveState]] = {
    ReceiveState.WAITING_SPACE: frozenset({ReceiveState.OFFERED, ReceiveState.FAILED}),
    ReceiveState.OFFERED: frozenset({ReceiveState.ACCEPTED, ReceiveState.FAILED}),
    ReceiveState.ACCEPTED: frozenset({ReceiveState.ANCHOR_READY, ReceiveState.FAILED}),
    ReceiveState.ANCHOR_READY: frozenset({ReceiveState.COMPLETE, ReceiveState.FAILED}),
    ReceiveState.COMPLETE: frozenset(),
    ReceiveState.FAILED: frozenset(),
}


class AuxStatus(enum.Enum):
    """What upstream's own receiver says of the request's aux data (its first token),
    reduced to what matters here."""

    PENDING = "pending"
    SUCCESS = "success"  # aux data (first token) landed
    FAILED = "failed"


STREAM_NAMES = {Stream.ANCHOR: "Anchor", Stream.RESIDUAL: "Residual"}


@dataclass
class ReceiveTracker:
    """One request's Lynx receive state. Fed by the ZMQ thread, read by the scheduler."""

    room: int
    local: Handshake
    deadline_s: float
    plan: RequestLayout  # what this request's transfer sends
    state: ReceiveState = ReceiveState.WAITING_SPACE
    error: str | None = None
    landed: dict[Stream, int] = field(default_factory=dict)  # stream -> bytes
    checksums: dict[Stream, tuple[int, ...]] = field(default_factory=dict)  # stream -> one per segment
    # the Residual of layers [0, residual_layers) landed, by LAYERS notices (LANDED: all)
    residual_layers: int = 0
    # per layer of those, the checksum of each Residual-stream segment's bytes of it
    layer_checksums: list[tuple[int, ...]] = field(default_factory=list)
    offered_at: float | None = None
    landed_at: dict[Stream, float] = field(default_factory=dict)
    upstream_success_at: float | None = None

    def move(self, state: ReceiveState) -> None:
        if state not in RECEIVE_TRANSITIONS[self.state]:
            raise ValueError(f"room {self.room}: Lynx receive state {self.state.value} -> {state.value}")
        self.state = state

    def fail(self, reason: str) -> None:
        if self.state not in (ReceiveState.FAILED, ReceiveState.COMPLETE):
            self.error = reason
            self.state = ReceiveState.FAILED

    def offered(self, now: float | None = None) -> None:
        self.move(ReceiveState.OFFERED)
        self.offered_at = time.monotonic() if now is None else now

    def on_notice(self, notice: Notice, peer: str, now: float | None = None) -> None:
        """Apply a prefill notice. ``peer`` names the prefill in error messages."""
        now = time.monotonic() if now is None else now
        if self.state in (ReceiveState.FAILED, ReceiveState.COMPLETE):
            return
        if notice.kind is NoticeKind.REJECT:
            self.fail(f"prefill {peer} refused the Lynx transfer: {notice.text}")
        elif notice.kind is NoticeKind.ACCEPT:
            try:
                theirs = parse_handshake(notice.handshake)
            except ProtocolError as exc:
                self.fail(f"prefill {peer} sent a Lynx handshake this server cannot read: {exc}")
                return
            mismatch = self.local.mismatch(theirs, this="this decode server", other=f"prefill {peer}")
            if mismatch is not None:
                self.fail(mismatch)
            elif self.state is ReceiveState.OFFERED:
                self.move(ReceiveState.ACCEPTED)
                self._advance()  # a LANDED may have come first
        elif notice.kind is NoticeKind.LAYERS:
            wrong = self._layers_mismatch(notice)
            if wrong is not None:
                self.fail(f"prefill {peer} reported {wrong}")
            elif Stream.RESIDUAL not in self.landed:
                count = notice.layers - notice.first_layer
                size = len(notice.checksums) // count
                self.layer_checksums += [notice.checksums[i * size : (i + 1) * size] for i in range(count)]
                self.residual_layers = notice.layers
        elif notice.kind is NoticeKind.LANDED:
            name = STREAM_NAMES[notice.stream]
            if not notice.ok:
                self.fail(f"prefill {peer} could not deliver the {name}: {notice.text}")
                return
            wrong = self._landed_mismatch(notice)
            if wrong is not None:
                self.fail(f"prefill {peer} reported the {name} landed with {wrong}")
                return
            self.landed[notice.stream] = notice.nbytes
            self.checksums[notice.stream] = notice.checksums
            self.landed_at[notice.stream] = now
            if notice.stream is Stream.RESIDUAL:
                self.residual_layers = self.plan.num_layers
            self._advance()

    def _layers_mismatch(self, notice: Notice) -> str | None:
        """How a LAYERS notice disagrees with the request's layout and what came before."""
        layers = self.plan.num_layers
        if Stream.RESIDUAL not in self.plan.streams:
            return "Residual layers landed, this request sends no Residual"
        if Stream.RESIDUAL in self.landed:
            return None  # late: LANDED said all
        if not (notice.first_layer == self.residual_layers < notice.layers < layers):
            return (
                f"the Residual of layers [{notice.first_layer}, {notice.layers}) landed, after layers "
                f"[0, {self.residual_layers}) of {layers} (LANDED says the last)"
            )
        segments = len(self.plan.stream_ranges(Stream.RESIDUAL)) if self.local.checksums else 0
        wanted = (notice.layers - notice.first_layer) * segments
        if len(notice.checksums) != wanted:
            return (
                f"layers [{notice.first_layer}, {notice.layers}) landed with {len(notice.checksums)} "
                f"checksums, this side wants {wanted}"
            )
        return None

    def _landed_mismatch(self, notice: Notice) -> str | None:
        """How a LANDED notice disagrees with the request's layout, or None."""
        if notice.stream not in self.plan.streams:
            return "a stream this request does not send"
        expected = self.plan.sent_nbytes()[notice.stream]
        if notice.stream in self.plan.variable_streams:
            if not 0 < notice.nbytes <= expected:  # each segment's own count is checked as it decodes
                return f"{notice.nbytes} bytes, the request's layout sends 1 to {expected}"
        elif notice.nbytes != expected:
            return f"{notice.nbytes} bytes, the request's layout sends {expected}"
        wanted = len(self.plan.stream_ranges(notice.stream)) if self.local.checksums else 0
        if len(notice.checksums) != wanted:
            return f"{len(notice.checksums)} checksums, this side wants {wanted}"
        return None

    def _advance(self) -> None:
        if self.state is ReceiveState.ACCEPTED and Stream.ANCHOR in self.landed:
            self.move(ReceiveState.ANCHOR_READY)
        if self.state is ReceiveState.ANCHOR_READY and all(s in self.landed for s in self.plan.streams):
            self.move(ReceiveState.COMPLETE)

    def verdict(self, upstream: AuxStatus, now: float | None = None) -> Verdict:
        """Whether the scheduler may decode the request now, must wait, or must fail it
        (then :attr:`error` says why)."""
        now = time.monotonic() if now is None else now
        if upstream is AuxStatus.FAILED:
            self.fail("the upstream KV transfer failed")
            self.error = self.error or "the upstream KV transfer failed"
            return Verdict.FAIL  # even if every Lynx byte landed: upstream's failure stands
        if self.state is ReceiveState.FAILED:
            return Verdict.FAIL
        if upstream is AuxStatus.PENDING:
            return Verdict.WAIT
        if self.upstream_success_at is None:
            self.upstream_success_at = now
        if self.state in (ReceiveState.WAITING_SPACE, ReceiveState.OFFERED):
            self.fail(
                "the prefill server finished the request without answering Lynx's handshake: "
                "start it with --lynx and the same --lynx-* flags"
            )
            return Verdict.FAIL
        wanted = ReceiveState.ANCHOR_READY if self.local.mode.starts_on_anchor else ReceiveState.COMPLETE
        order = list(RECEIVE_TRANSITIONS)
        if order.index(self.state) >= order.index(wanted):
            return Verdict.READY
        return self._past_deadline(now)

    def residual_verdict(self, now: float | None = None) -> Verdict:
        """Speculative mode, after decoding started on the Anchor: may the request be
        refined (READY), must it wait, or will its Residual never come (FAIL)?"""
        now = time.monotonic() if now is None else now
        if self.state is ReceiveState.COMPLETE:
            return Verdict.READY
        if self.state is ReceiveState.FAILED:
            return Verdict.FAIL
        if self.upstream_success_at is None:
            raise ValueError(f"room {self.room}: asked for the Residual before the first token landed")
        return self._past_deadline(now)

    def _past_deadline(self, now: float) -> Verdict:
        assert self.upstream_success_at is not None
        if now - self.upstream_success_at > self.deadline_s:
            missing = "Anchor" if Stream.ANCHOR not in self.landed else "Residual"
            self.fail(
                f"the {missing} did not land within {self.deadline_s:g}s of the first token "
                "(--lynx-transfer-deadline): the prefill server stalled or the link is too slow"
            )
            return Verdict.FAIL
        return Verdict.WAIT
