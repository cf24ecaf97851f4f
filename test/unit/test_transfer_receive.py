"""ReceiveTracker: decode's per-request state machine and the verdict the scheduler polls."""

from __future__ import annotations

import pytest
import torch

from lynx.codec import CodecConfig, KVLayout
from lynx.mode import Mode
from lynx.transfer import (
    RECEIVE_TRANSITIONS,
    AuxStatus,
    Handshake,
    Notice,
    NoticeKind,
    ReceiveState,
    ReceiveTracker,
    RequestLayout,
    Stream,
    Verdict,
)

LAYOUT = KVLayout(4, 2, 64, torch.bfloat16)
PEER = "10.0.0.2:8998"
DEADLINE = 5.0
N_TOKENS = 300  # two segments
NONCE = 99  # the tracker is given only notices of its reservation: any nonce does
S = ReceiveState


def local(mode: Mode = "full", residual: str = "exact") -> Handshake:
    return Handshake(mode, CodecConfig(residual=residual), LAYOUT, checksums=True)  # type: ignore[arg-type]


def plan(mode: Mode = "full", residual: str = "exact") -> RequestLayout:
    return RequestLayout.of(local(mode, residual), N_TOKENS)


def tracker(mode: Mode = "full", *, accepted: bool = True, residual: str = "exact") -> ReceiveTracker:
    t = ReceiveTracker(room=7, local=local(mode, residual), deadline_s=DEADLINE, plan=plan(mode, residual))
    t.offered(now=0.0)
    if accepted:
        t.on_notice(accept(local(mode, residual)), PEER, now=0.5)
    return t


def accept(handshake: Handshake) -> Notice:
    return Notice(NoticeKind.ACCEPT, 7, NONCE, handshake=handshake.to_wire())


def landed(
    stream: Stream,
    nbytes: int | None = None,
    ok: bool = True,
    text: str = "",
    checksums: tuple[int, ...] | None = None,
    mode: Mode = "full",
    residual: str = "exact",
) -> Notice:
    """A LANDED notice; by default what the request's layout sends on ``stream``, with a
    checksum per segment."""
    layout = plan(mode, residual)
    return Notice(
        NoticeKind.LANDED,
        7,
        NONCE,
        stream=stream,
        ok=ok,
        nbytes=layout.sent_nbytes()[stream] if nbytes is None else nbytes,
        checksums=tuple(range(len(layout.stream_ranges(stream)))) if checksums is None else checksums,
        text=text,
    )


def test_receive_state_machine_is_pinned() -> None:
    assert {k: set(v) for k, v in RECEIVE_TRANSITIONS.items()} == {
        S.WAITING_SPACE: {S.OFFERED, S.FAILED},
        S.OFFERED: {S.ACCEPTED, S.FAILED},
        S.ACCEPTED: {S.ANCHOR_READY, S.FAILED},
        S.ANCHOR_READY: {S.COMPLETE, S.FAILED},
        S.COMPLETE: set(),
        S.FAILED: set(),
    }
    # verdict() compares states by their position in this dict: keep it in pipeline order
    assert list(RECEIVE_TRANSITIONS) == list(ReceiveState)


@pytest.mark.parametrize(
    ("start", "to"),
    [
        (S.WAITING_SPACE, S.ACCEPTED),
        (S.OFFERED, S.ANCHOR_READY),
        (S.ACCEPTED, S.COMPLETE),
        (S.COMPLETE, S.FAILED),
        (S.FAILED, S.OFFERED),
        (S.OFFERED, S.OFFERED),
    ],
)
def test_illegal_moves_raise(start: ReceiveState, to: ReceiveState) -> None:
    t = ReceiveTracker(room=3, local=local(), deadline_s=DEADLINE, plan=plan(), state=start)
    with pytest.raises(ValueError, match=f"room 3: Lynx receive state {start.value} -> {to.value}"):
        t.move(to)
    assert t.state is start


def test_offered_records_the_time_and_moves() -> None:
    t = ReceiveTracker(room=7, local=local(), deadline_s=DEADLINE, plan=plan())
    assert t.state is S.WAITING_SPACE
    t.offered(now=12.5)
    assert (t.state, t.offered_at) == (S.OFFERED, 12.5)
    with pytest.raises(ValueError):
        t.offered(now=13.0)  # only once


@pytest.mark.parametrize("state", [S.WAITING_SPACE, S.OFFERED, S.ACCEPTED, S.ANCHOR_READY, S.COMPLETE])
def test_wait_while_upstream_pending(state: ReceiveState) -> None:
    t = ReceiveTracker(room=7, local=local(), deadline_s=DEADLINE, plan=plan(), state=state)
    assert t.verdict(AuxStatus.PENDING, now=1e9) is Verdict.WAIT
    assert t.state is state and t.error is None
    assert t.upstream_success_at is None  # the deadline only runs from upstream's Success


@pytest.mark.parametrize("state", [S.WAITING_SPACE, S.OFFERED, S.ACCEPTED, S.ANCHOR_READY])
def test_upstream_failure_fails(state: ReceiveState) -> None:
    t = ReceiveTracker(room=7, local=local(), deadline_s=DEADLINE, plan=plan(), state=state)
    assert t.verdict(AuxStatus.FAILED, now=0.0) is Verdict.FAIL
    assert t.state is S.FAILED
    assert t.error == "the upstream KV transfer failed"


def test_upstream_failure_stands_even_when_every_byte_landed() -> None:
    t = tracker("full")
    t.on_notice(landed(Stream.ANCHOR), PEER, now=1.0)
    t.on_notice(landed(Stream.RESIDUAL), PEER, now=1.5)
    assert t.state is S.COMPLETE
    assert t.verdict(AuxStatus.FAILED, now=2.0) is Verdict.FAIL
    assert t.error == "the upstream KV transfer failed"


def test_a_landing_before_the_accept_counts_once_accepted() -> None:
    t = tracker("anchor-only", accepted=False)
    t.on_notice(landed(Stream.ANCHOR), PEER, now=1.0)
    assert t.state is S.OFFERED
    t.on_notice(accept(local("anchor-only")), PEER, now=1.1)
    assert t.state is S.COMPLETE
    assert t.verdict(AuxStatus.SUCCESS, now=1.2) is Verdict.READY


@pytest.mark.parametrize("state", [S.WAITING_SPACE, S.OFFERED])
def test_upstream_success_without_accept_fails_naming_the_flag(state: ReceiveState) -> None:
    t = ReceiveTracker(room=7, local=local(), deadline_s=DEADLINE, plan=plan(), state=state)
    assert t.verdict(AuxStatus.SUCCESS, now=0.0) is Verdict.FAIL
    assert t.state is S.FAILED
    assert t.error is not None
    assert "without answering Lynx's handshake" in t.error
    assert "--lynx" in t.error
    assert t.verdict(AuxStatus.SUCCESS, now=0.1) is Verdict.FAIL  # and stays failed


def test_full_mode_waits_for_the_residual() -> None:
    t = tracker("full")
    assert t.state is S.ACCEPTED
    assert t.verdict(AuxStatus.SUCCESS, now=1.0) is Verdict.WAIT
    t.on_notice(landed(Stream.ANCHOR, checksums=(1, 2)), PEER, now=1.5)
    assert t.state is S.ANCHOR_READY
    assert t.verdict(AuxStatus.SUCCESS, now=2.0) is Verdict.WAIT
    t.on_notice(landed(Stream.RESIDUAL, checksums=(3, 4)), PEER, now=2.5)
    assert t.state is S.COMPLETE
    assert t.verdict(AuxStatus.SUCCESS, now=3.0) is Verdict.READY
    assert t.landed == plan().sent_nbytes()
    assert t.checksums == {Stream.ANCHOR: (1, 2), Stream.RESIDUAL: (3, 4)}  # for write_kv to check
    assert t.landed_at == {Stream.ANCHOR: 1.5, Stream.RESIDUAL: 2.5}
    assert t.upstream_success_at == 1.0
    assert t.error is None


def test_full_mode_residual_landing_first_waits_for_the_anchor() -> None:
    t = tracker("full")
    t.on_notice(landed(Stream.RESIDUAL), PEER, now=1.0)
    assert t.state is S.ACCEPTED
    assert t.verdict(AuxStatus.SUCCESS, now=1.0) is Verdict.WAIT
    t.on_notice(landed(Stream.ANCHOR), PEER, now=2.0)
    assert t.state is S.COMPLETE
    assert t.verdict(AuxStatus.SUCCESS, now=2.0) is Verdict.READY


def test_anchor_only_decodes_after_the_anchor() -> None:
    t = tracker("anchor-only")
    assert t.verdict(AuxStatus.SUCCESS, now=1.0) is Verdict.WAIT
    t.on_notice(landed(Stream.ANCHOR), PEER, now=1.5)
    assert t.state is S.COMPLETE  # nothing else will come
    assert t.verdict(AuxStatus.SUCCESS, now=2.0) is Verdict.READY


def test_speculative_decodes_on_the_anchor_and_completes_on_the_residual() -> None:
    t = tracker("speculative")
    t.on_notice(landed(Stream.ANCHOR), PEER, now=1.0)
    assert t.state is S.ANCHOR_READY
    assert t.verdict(AuxStatus.SUCCESS, now=1.0) is Verdict.READY
    t.on_notice(landed(Stream.RESIDUAL), PEER, now=2.0)
    assert t.state is S.COMPLETE


SEGMENTS = len(plan("speculative").stream_ranges(Stream.RESIDUAL))


def layers_landed(first: int, n: int, checksums: tuple[int, ...] | None = None) -> Notice:
    """LAYERS of layers [first, n), with a checksum per layer and segment by default."""
    if checksums is None:
        checksums = tuple(range(100 * first, 100 * first + (n - first) * SEGMENTS))
    return Notice(NoticeKind.LAYERS, 7, NONCE, layers=n, first_layer=first, checksums=checksums)


def test_layers_notices_count_the_residual_layers_that_landed_until_it_all_did() -> None:
    t = tracker("speculative")
    t.on_notice(layers_landed(0, 1), PEER, now=0.8)  # may come before the Anchor's LANDED
    t.on_notice(landed(Stream.ANCHOR, mode="speculative"), PEER, now=1.0)
    t.on_notice(layers_landed(1, 3), PEER, now=1.1)
    assert (t.residual_layers, t.state) == (3, S.ANCHOR_READY)
    assert t.layer_checksums == [(0, 1), (100, 101), (102, 103)]  # per layer, one per segment
    t.on_notice(landed(Stream.RESIDUAL, mode="speculative"), PEER, now=2.0)
    assert (t.residual_layers, t.state) == (LAYOUT.num_layers, S.COMPLETE)


OUT_OF_ORDER = "the Residual of layers [{}, {}) landed, after layers [0, {}) of 4 (LANDED says the last)"


@pytest.mark.parametrize(
    ("notices", "why"),
    [
        ([layers_landed(0, 0)], OUT_OF_ORDER.format(0, 0, 0)),
        ([layers_landed(0, 4)], OUT_OF_ORDER.format(0, 4, 0)),
        ([layers_landed(0, 9)], OUT_OF_ORDER.format(0, 9, 0)),
        ([layers_landed(1, 2)], OUT_OF_ORDER.format(1, 2, 0)),
        ([layers_landed(0, 2), layers_landed(0, 3)], OUT_OF_ORDER.format(0, 3, 2)),
        ([layers_landed(0, 2, (1, 2, 3))], "layers [0, 2) landed with 3 checksums, this side wants 4"),
    ],
)
def test_a_layers_notice_out_of_order_or_outside_the_request_fails_it(
    notices: list[Notice], why: str
) -> None:
    t = tracker("speculative")
    for notice in notices:
        t.on_notice(notice, PEER, now=1.0)
    assert (t.state, t.error) == (S.FAILED, f"prefill {PEER} reported {why}")


def test_a_layers_notice_for_a_request_without_a_residual_fails_it() -> None:
    t = tracker("anchor-only")
    t.on_notice(layers_landed(0, 1, ()), PEER, now=1.0)
    assert (t.state, t.error) == (
        S.FAILED,
        f"prefill {PEER} reported Residual layers landed, this request sends no Residual",
    )


@pytest.mark.parametrize("mode", ["full", "speculative"])
def test_every_token_protected_completes_on_the_anchor(mode: Mode) -> None:
    handshake = Handshake(mode, CodecConfig(), LAYOUT, protect_first=200, protect_last=200, checksums=True)
    layout = RequestLayout.of(handshake, N_TOKENS)
    assert layout.streams == (Stream.ANCHOR,)  # the Residual region is empty: no stream
    t = ReceiveTracker(room=7, local=handshake, deadline_s=DEADLINE, plan=layout)
    t.offered(now=0.0)
    t.on_notice(accept(handshake), PEER, now=0.5)
    assert t.verdict(AuxStatus.SUCCESS, now=1.0) is Verdict.WAIT
    t.on_notice(landed(Stream.RESIDUAL), PEER, now=1.2)  # not a stream of this request
    assert t.error == f"prefill {PEER} reported the Residual landed with a stream this request does not send"
    t = ReceiveTracker(room=7, local=handshake, deadline_s=DEADLINE, plan=layout)
    t.offered(now=0.0)
    t.on_notice(accept(handshake), PEER, now=0.5)
    nbytes, segments = layout.anchor_nbytes, len(layout.stream_ranges(Stream.ANCHOR))
    t.on_notice(landed(Stream.ANCHOR, nbytes, checksums=(0,) * segments), PEER, now=1.5)
    assert t.state is S.COMPLETE  # nothing else will come
    assert t.verdict(AuxStatus.SUCCESS, now=2.0) is Verdict.READY
    assert t.residual_verdict(now=2.0) is Verdict.READY


def test_anchor_ready_but_upstream_pending_waits() -> None:
    t = tracker("anchor-only")
    t.on_notice(landed(Stream.ANCHOR), PEER, now=1.0)
    assert t.verdict(AuxStatus.PENDING, now=1.0) is Verdict.WAIT


@pytest.mark.parametrize(("stream", "name"), [(Stream.ANCHOR, "Anchor"), (Stream.RESIDUAL, "Residual")])
def test_failed_landing_fails_with_the_stream_name(stream: Stream, name: str) -> None:
    t = tracker("full")
    t.on_notice(landed(stream, 0, ok=False, text="HIGH write to d:1 failed in the engine"), PEER, now=1.0)
    assert t.state is S.FAILED
    assert t.error == (f"prefill {PEER} could not deliver the {name}: HIGH write to d:1 failed in the engine")
    assert t.landed == {}
    assert t.verdict(AuxStatus.SUCCESS, now=1.0) is Verdict.FAIL


@pytest.mark.parametrize("stream", [Stream.ANCHOR, Stream.RESIDUAL])
@pytest.mark.parametrize("delta", [-1, 1, None])  # short, long, nothing at all
def test_a_landing_of_another_byte_count_fails_naming_both(stream: Stream, delta: int | None) -> None:
    """LANDED completes a stream of fixed-size segments only with the bytes the request's
    layout puts on it: a short count (or 0, which once made a request decode stale bytes)
    fails it."""
    expected = plan(residual="int8").sent_nbytes()[stream]
    nbytes = 0 if delta is None else expected + delta
    t = tracker("full", residual="int8")
    t.on_notice(landed(stream, nbytes, residual="int8"), PEER, now=1.0)
    assert t.state is S.FAILED and t.landed == {}
    name = "Anchor" if stream is Stream.ANCHOR else "Residual"
    assert t.error == (
        f"prefill {PEER} reported the {name} landed with {nbytes} bytes, "
        f"the request's layout sends {expected}"
    )
    assert t.verdict(AuxStatus.SUCCESS, now=2.0) is Verdict.FAIL


@pytest.mark.parametrize("delta", [-1000, 0, 1, None])
def test_a_lossless_residual_lands_with_at_most_its_space(delta: int | None) -> None:
    """A stream of lossless Residuals sends as many bytes as they coded: any count up to the
    request's space lands (decode checks each segment's own count as it decodes); more
    than the space, or nothing, fails."""
    space = plan().sent_nbytes()[Stream.RESIDUAL]
    nbytes = 0 if delta is None else space + delta
    t = tracker("full")
    t.on_notice(landed(Stream.RESIDUAL, nbytes), PEER, now=1.0)
    if delta is not None and delta <= 0:
        assert t.state is S.ACCEPTED and t.landed == {Stream.RESIDUAL: nbytes}
        return
    assert t.state is S.FAILED
    assert t.error == (
        f"prefill {PEER} reported the Residual landed with {nbytes} bytes, "
        f"the request's layout sends 1 to {space}"
    )


@pytest.mark.parametrize("checksums", [(), (1,), (1, 2, 3)])
def test_a_landing_needs_one_checksum_per_segment(checksums: tuple[int, ...]) -> None:
    t = tracker("full")
    t.on_notice(landed(Stream.ANCHOR, checksums=checksums), PEER, now=1.0)
    assert t.state is S.FAILED
    assert t.error == (
        f"prefill {PEER} reported the Anchor landed with {len(checksums)} checksums, this side wants 2"
    )


def test_without_checksums_a_landing_carries_none() -> None:
    handshake = Handshake("full", CodecConfig(), LAYOUT)
    t = ReceiveTracker(
        room=7, local=handshake, deadline_s=DEADLINE, plan=RequestLayout.of(handshake, N_TOKENS)
    )
    t.offered(now=0.0)
    t.on_notice(accept(handshake), PEER, now=0.5)
    t.on_notice(landed(Stream.ANCHOR, checksums=()), PEER, now=1.0)
    assert t.state is S.ANCHOR_READY and t.checksums == {Stream.ANCHOR: ()}
    t.on_notice(landed(Stream.RESIDUAL, checksums=(1, 2)), PEER, now=1.0)
    assert t.error == f"prefill {PEER} reported the Residual landed with 2 checksums, this side wants 0"


def test_reject_fails_with_the_reason() -> None:
    t = tracker("full", accepted=False)
    t.on_notice(Notice(NoticeKind.REJECT, 7, NONCE, text="settings differ: anchor_bits=2"), PEER, now=1.0)
    assert t.state is S.FAILED
    assert t.error == f"prefill {PEER} refused the Lynx transfer: settings differ: anchor_bits=2"
    assert t.verdict(AuxStatus.PENDING, now=1.0) is Verdict.FAIL


def test_accept_with_other_settings_fails_naming_both() -> None:
    t = tracker("full", accepted=False)
    theirs = Handshake("full", CodecConfig(anchor_bits=3), LAYOUT, checksums=True)
    t.on_notice(accept(theirs), PEER, now=1.0)
    assert t.state is S.FAILED
    assert t.error is not None
    assert f"this decode server ({local().describe()})" in t.error
    assert f"prefill {PEER} ({theirs.describe()})" in t.error


def test_accept_with_an_unreadable_handshake_fails() -> None:
    t = tracker("full", accepted=False)
    t.on_notice(Notice(NoticeKind.ACCEPT, 7, NONCE, handshake=b"LXHS\x08\x00"), PEER, now=1.0)
    assert t.state is S.FAILED
    assert t.error is not None
    assert f"prefill {PEER} sent a Lynx handshake this server cannot read" in t.error
    assert "protocol v8" in t.error


@pytest.mark.parametrize(
    ("mode", "anchor", "missing"),
    [("full", False, "Anchor"), ("full", True, "Residual"), ("anchor-only", False, "Anchor")],
)
def test_deadline_from_upstream_success(mode: Mode, anchor: bool, missing: str) -> None:
    t = tracker(mode)
    if anchor:
        t.on_notice(landed(Stream.ANCHOR), PEER, now=1.0)
    assert t.verdict(AuxStatus.SUCCESS, now=100.0) is Verdict.WAIT
    assert t.verdict(AuxStatus.SUCCESS, now=100.0 + DEADLINE) is Verdict.WAIT  # not yet past it
    assert t.verdict(AuxStatus.SUCCESS, now=100.0 + DEADLINE + 0.01) is Verdict.FAIL
    assert t.state is S.FAILED
    assert t.error == (
        f"the {missing} did not land within 5s of the first token (--lynx-transfer-deadline): "
        "the prefill server stalled or the link is too slow"
    )


def test_deadline_does_not_apply_once_decodable() -> None:
    t = tracker("anchor-only")
    assert t.verdict(AuxStatus.SUCCESS, now=0.0) is Verdict.WAIT
    t.on_notice(landed(Stream.ANCHOR), PEER, now=1.0)
    assert t.verdict(AuxStatus.SUCCESS, now=1e6) is Verdict.READY


def test_terminal_states_ignore_later_notices() -> None:
    t = tracker("full")
    t.on_notice(Notice(NoticeKind.REJECT, 7, NONCE, text="first"), PEER, now=1.0)
    error = t.error
    t.on_notice(landed(Stream.ANCHOR), PEER, now=2.0)
    t.on_notice(Notice(NoticeKind.REJECT, 7, NONCE, text="second"), PEER, now=2.0)
    t.fail("third")
    assert (t.state, t.error, t.landed) == (S.FAILED, error, {})

    done = tracker("anchor-only")
    done.on_notice(landed(Stream.ANCHOR), PEER, now=1.0)
    done.on_notice(landed(Stream.ANCHOR, ok=False, text="late"), PEER, now=2.0)
    done.fail("too late")
    assert (done.state, done.error) == (S.COMPLETE, None)


def test_a_second_accept_is_harmless() -> None:
    t = tracker("full")
    t.on_notice(accept(local()), PEER, now=1.0)
    assert t.state is S.ACCEPTED


def test_residual_verdict_after_decoding_on_the_anchor() -> None:
    """Speculative mode: decoding started on the Anchor; the Residual then lands, fails,
    or misses the deadline (counted from the first token)."""

    def started() -> ReceiveTracker:
        t = tracker("speculative")
        t.on_notice(landed(Stream.ANCHOR), PEER, now=0.6)
        assert t.verdict(AuxStatus.SUCCESS, now=1.0) is Verdict.READY
        return t

    t = started()
    assert t.residual_verdict(now=5.0) is Verdict.WAIT
    t.on_notice(landed(Stream.RESIDUAL), PEER, now=5.5)
    assert t.residual_verdict(now=5.5) is Verdict.READY
    t = started()
    assert t.residual_verdict(now=1.0 + DEADLINE + 0.1) is Verdict.FAIL
    assert t.error is not None and f"Residual did not land within {DEADLINE:g}s" in t.error
    t = started()
    t.on_notice(landed(Stream.RESIDUAL, 0, ok=False, text="lane down"), PEER, now=2.0)
    assert t.residual_verdict(now=2.0) is Verdict.FAIL
    with pytest.raises(ValueError, match="before the first token"):
        tracker("speculative").residual_verdict(now=0.0)
