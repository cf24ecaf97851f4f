"""ProgressiveSender -> ProgressiveReceiver in one process, over a fake engine that copies
bytes between two CPU buffers: offer, encode, lanes, notices, decode, release."""

from __future__ import annotations

import ctypes
import itertools
import struct
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from lynx.codec import CodecConfig, KVLayout, decode, encode, encode_pages, residual_layer_ends
from lynx.lanes import BatchState, LaneConfig, Transfer
from lynx.mode import Mode
from lynx.transfer import (
    AuxStatus,
    DuplicateRoomError,
    Handshake,
    Notice,
    NoticeKind,
    Offer,
    OfferBinding,
    ProgressiveReceiver,
    ProgressiveSender,
    ReceiveCapacityError,
    ReceiveIntegrityError,
    RequestLayout,
    Stream,
    Verdict,
    layer_streams,
    page_slots,
)
from lynx.transfer.arena import ByteArena
from lynx.transfer.auth import AuthKey
from lynx.transfer.protocol import TAG, checksum_values, span_checksum, split_offer

LAYERS, HEADS, HEAD_DIM, ROWS = 4, 2, 64, 2048
LAYOUT = KVLayout(LAYERS, HEADS, HEAD_DIM, torch.bfloat16)
N_TOKENS = 600  # segments of 256, 256 and 88 tokens
DECODE_ENDPOINT = ("10.0.0.2", 9000)
DECODE_SESSION = "decode:1"
PREFILL_ADDR = "10.0.0.1:8998"
WAIT_S = 30.0  # how long a wait may take before the test gives up (never a pass criterion)


@pytest.fixture(autouse=True)
def one_codec_thread() -> Iterator[None]:
    """The CPU codec runs on torch's thread count; on this little data, and a busy 2-core
    host, a team of threads mostly waits on its barriers."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---- a fake engine -----------------------------------------------------------------------------


@dataclass
class FakeBatch:
    index: int
    transfers: list[Transfer]
    copied: bool = False


class CopyBackend:
    """Copies each batch with memmove when first polled after it may complete. ``fail_batch``:
    that batch (0-based) fails instead; ``hold``: nothing completes while it is set;
    ``lands``: while set, only a batch whose every transfer it passes completes.
    ``device_source``: a CUDA send buffer, whose bytes are read through the host."""

    session_id = "prefill:1"

    def __init__(self, *, fail_batch: int | None = None, hold: bool = False) -> None:
        self.fail_batch = fail_batch
        self.hold = threading.Event()
        if hold:
            self.hold.set()
        self.lock = threading.Lock()
        self.batches: list[FakeBatch] = []
        self.registered: dict[int, int] = {}
        self.device_source: torch.Tensor | None = None
        self.lands: Callable[[Transfer], bool] | None = None

    def probe(self, peer: str) -> bool:
        return peer == DECODE_SESSION

    def register_memory(self, addr: int, length: int) -> None:
        self.registered[addr] = length

    def unregister_memory(self, addr: int) -> None:
        del self.registered[addr]

    def submit_write(self, peer: str, transfers: Sequence[Transfer]) -> FakeBatch:
        assert peer == DECODE_SESSION
        with self.lock:
            batch = FakeBatch(len(self.batches), list(transfers))
            self.batches.append(batch)
        return batch

    def poll(self, handle: object) -> BatchState:
        assert isinstance(handle, FakeBatch)
        if self.hold.is_set():
            return BatchState.PENDING
        if handle.index == self.fail_batch:
            return BatchState.FAILED
        lands = self.lands
        if lands is not None and not all(lands(t) for t in handle.transfers):
            return BatchState.PENDING
        if not handle.copied:
            for t in handle.transfers:
                if self.device_source is None:
                    ctypes.memmove(t.dst, t.src, t.length)
                    continue
                at = t.src - self.device_source.data_ptr()
                staged = self.device_source[at : at + t.length].cpu()
                ctypes.memmove(t.dst, staged.data_ptr(), t.length)
            handle.copied = True
        return BatchState.DONE

    def written(self) -> list[Transfer]:
        with self.lock:
            return [t for b in self.batches for t in b.transfers]


# ---- both sides in one process -----------------------------------------------------------------


def kv_pool(seed: int | None, device: str = "cpu") -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Random bf16 K and V layer buffers; zeros when ``seed`` is None."""
    shape = (ROWS, HEADS, HEAD_DIM)
    if seed is None:
        return (
            [torch.zeros(shape, dtype=torch.bfloat16, device=device) for _ in range(LAYERS)],
            [torch.zeros(shape, dtype=torch.bfloat16, device=device) for _ in range(LAYERS)],
        )
    gen = torch.Generator().manual_seed(seed)
    k = [torch.randn(shape, generator=gen).to(device, torch.bfloat16) for _ in range(LAYERS)]
    v = [torch.randn(shape, generator=gen).to(device, torch.bfloat16) for _ in range(LAYERS)]
    return k, v


def request_nbytes(handshake: Handshake, n_tokens: int = N_TOKENS) -> int:
    plan = RequestLayout.of(handshake, n_tokens)
    return ByteArena.rounded(plan.anchor_nbytes + plan.residual_nbytes)


def wait_for(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.002)


class Pair:
    def __init__(
        self,
        *,
        mode: Mode = "full",
        codec: CodecConfig | None = None,
        decode_codec: CodecConfig | None = None,
        protect: tuple[int, int] = (0, 0),
        decode_protect: tuple[int, int] | None = None,
        backend: CopyBackend | None = None,
        send_bytes: int | None = None,
        recv_bytes: int | None = None,
        page_size: int = 1,
        landed_delay_s: float = 0.0,
        residual_hold_s: float = 0.0,
        anchor_hold_s: float = 0.0,
        offer_wait_s: float = 60.0,
        checksums: bool = False,
        decode_checksums: bool | None = None,
        keys: tuple[AuthKey | None, AuthKey | None] = (None, None),
        layerwise_from: int = 0,
        layer_send_bytes: int | None = 0,
        device: str = "cpu",
    ) -> None:
        """``keys``: prefill's and decode's (--lynx-auth-key-file); ``device``: prefill's
        pool and send buffer's (decode's stay on the CPU)."""
        codec = codec or CodecConfig()
        self.landed_delay_s = landed_delay_s
        self.handshake = Handshake(mode, codec, LAYOUT, *protect, checksums)
        decode_handshake = Handshake(
            mode,
            decode_codec or codec,
            LAYOUT,
            *(decode_protect or protect),
            checksums if decode_checksums is None else decode_checksums,
        )
        self.page_size = page_size
        self.backend = backend or CopyBackend()
        self.prefill_k, self.prefill_v = kv_pool(seed=0, device=device)
        self.decode_k, self.decode_v = kv_pool(seed=None)
        self.lock = threading.Lock()
        self.notices: list[Notice] = []
        self.frames: list[list[bytes]] = []  # every notice's frames, as sent
        self.failures: list[tuple[int, str]] = []
        self.dropped: list[str] = []
        self.receive_buffer = torch.zeros(
            recv_bytes or 4 * request_nbytes(decode_handshake), dtype=torch.uint8
        )
        self.receiver = ProgressiveReceiver(
            buffer=self.receive_buffer,
            k_buffers=self.decode_k,
            v_buffers=self.decode_v,
            handshake=decode_handshake,
            deadline_s=600.0,
            on_dropped=self.dropped.append,
            auth=keys[1],
        )
        self.send_buffer = torch.zeros(
            send_bytes or 4 * request_nbytes(self.handshake), dtype=torch.uint8, device=device
        )
        if self.send_buffer.is_cuda:
            self.backend.device_source = self.send_buffer
        self.sender = ProgressiveSender(
            backend=self.backend,
            buffer=self.send_buffer,
            k_buffers=self.prefill_k,
            v_buffers=self.prefill_v,
            page_size=page_size,
            handshake=self.handshake,
            lane_config=LaneConfig(low_chunk_s=None, low_chunk_bytes=16 << 10, low_chunk_min_bytes=4 << 10),
            notify=self._notify,
            on_failure=self._on_failure,
            hold_s=(anchor_hold_s, residual_hold_s),
            offer_wait_s=offer_wait_s,
            auth=keys[0],
            layerwise_from=layerwise_from,
            layer_send_bytes=layer_send_bytes,
        )

    def _notify(self, endpoint: tuple[str, int], frames: list[bytes]) -> None:
        assert endpoint == DECODE_ENDPOINT
        notice = Notice.from_frames(frames)
        if notice.kind is NoticeKind.LANDED:
            time.sleep(self.landed_delay_s)  # a slow socket: widens any race with RELEASED
        with self.lock:
            self.notices.append(notice)
            self.frames.append(frames)
        self.receiver.on_notice(frames)

    def _on_failure(self, room: int, reason: str) -> None:
        with self.lock:
            self.failures.append((room, reason))

    def kinds(self, room: int) -> list[NoticeKind]:
        with self.lock:
            return [n.kind for n in self.notices if n.room == room]

    def settling(self, room: int) -> list[NoticeKind]:
        """The kinds of the room's notices but LAYERS, after checking those: as many as
        the lanes' progress made (coalesced), each for more layers, fewer than all, and
        all of them before the Residual's LANDED."""
        with self.lock:
            notices = [n for n in self.notices if n.room == room]
        layers = [n.layers for n in notices if n.kind is NoticeKind.LAYERS]
        assert layers == sorted(set(layers)) and all(0 < n < LAYERS for n in layers), layers
        if layers:
            residual_landed = next(
                i
                for i, n in enumerate(notices)
                if n.kind is NoticeKind.LANDED and n.stream is Stream.RESIDUAL
            )
            assert all(n.kind is not NoticeKind.LAYERS for n in notices[residual_landed:])
        return [n.kind for n in notices if n.kind is not NoticeKind.LAYERS]

    def reserve(self, room: int, n_tokens: int = N_TOKENS) -> Offer | None:
        """Decode takes the request and reserves its space (None: none is free); the offer
        as its metadata message carries it (signed, with a key)."""
        self.receiver.register(room, n_tokens, peer=PREFILL_ADDR)
        return None if self.receiver.reserve(room) is None else self.sent_offer(room)

    def sent_offer(self, room: int, session: str = DECODE_SESSION) -> Offer:
        """The room's offer as decode appends it to its metadata message from ``session``."""
        frames = self.receiver.append_offer([], OfferBinding(room, session, DECODE_ENDPOINT))
        offer_bytes = split_offer(frames)[1]
        assert offer_bytes is not None
        return Offer.from_wire(offer_bytes)

    def answer(self, room: int, offer_bytes: bytes | None, n_tokens: int = N_TOKENS) -> Offer | str | None:
        """Decode's metadata reaches prefill before prefill's request of ``n_tokens``
        tokens exists (upstream's usual order); prefill answers once it knows the length."""
        assert self.sender.take_offer(room, offer_bytes, DECODE_ENDPOINT, DECODE_SESSION) is None
        self.sender.open_room(room)
        return self.sender.size_room(room, n_tokens)

    def offer(self, room: int, n_tokens: int = N_TOKENS) -> Offer:
        """Decode reserves space; prefill accepts its offer."""
        offer = self.reserve(room, n_tokens)
        assert offer is not None
        assert self.answer(room, offer.to_wire(), n_tokens) == offer
        return offer

    def pages(self, seed: int, n_tokens: int = N_TOKENS) -> np.ndarray:
        """Distinct random prefill pages for a request of ``n_tokens`` tokens."""
        n_pages = -(-n_tokens // self.page_size)
        gen = torch.Generator().manual_seed(seed)
        return torch.randperm(ROWS // self.page_size, generator=gen)[:n_pages].numpy()

    def chunk(self, room: int, offer: Offer, pages: np.ndarray, last: bool) -> None:
        """``add_chunk``, then ``pump`` as the server's poll of the request does."""
        self.sender.add_chunk(room, pages, last)
        self.sender.pump()

    def send(self, room: int, offer: Offer, pages: np.ndarray, chunks: Sequence[int]) -> None:
        """``add_chunk`` for each run of ``chunks`` pages, the last one with last=True."""
        at = 0
        for i, n in enumerate(chunks):
            last = i == len(chunks) - 1
            self.chunk(room, offer, pages[at:] if last else pages[at : at + n], last)
            at += n

    def verdict(self, room: int) -> tuple[Verdict, str | None]:
        return self.receiver.verdict(room, AuxStatus.SUCCESS)

    def wait_verdict(self, room: int, expected: Verdict) -> str | None:
        got: list[tuple[Verdict, str | None]] = []

        def settled() -> bool:
            got.append(self.verdict(room))
            return got[-1][0] is not Verdict.WAIT

        wait_for(settled, f"room {room} to settle")
        assert got[-1][0] is expected, got[-1]
        return got[-1][1]

    def wait_released(self, room: int) -> None:
        wait_for(lambda: NoticeKind.RELEASED in self.kinds(room), f"RELEASED of room {room}")

    def prefill_rows(self, slots: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return [k[slots] for k in self.prefill_k], [v[slots] for v in self.prefill_v]

    def decode_rows(self, slots: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        return [k[slots] for k in self.decode_k], [v[slots] for v in self.decode_v]


@pytest.fixture
def pairs() -> Iterator[Callable[..., Pair]]:
    made: list[Pair] = []

    def make(**kwargs: object) -> Pair:
        pair = Pair(**kwargs)  # type: ignore[arg-type]
        made.append(pair)
        return pair

    yield make
    for pair in made:
        pair.sender.close()


def reference_rows(
    rows: tuple[list[torch.Tensor], list[torch.Tensor]],
    config: CodecConfig,
    *,
    residual: bool,
    protect: tuple[int, int] = (0, 0),
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """What decode must hold: each segment of each layer's K and V through the codec's
    tensor API, with the Residual if ``residual`` or the segment is protected."""
    plan = RequestLayout(
        LAYOUT, config, rows[0][0].shape[0], Mode.FULL, protect_first=protect[0], protect_last=protect[1]
    )
    out: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
    for kind, source, dest in (("key", rows[0], out[0]), ("value", rows[1], out[1])):
        for layer_rows in source:
            pieces = []
            for seg in plan.segments:
                part = layer_rows[seg.start : seg.end]
                enc = encode(part, config, kind=kind)  # type: ignore[arg-type]
                pieces.append(
                    decode(
                        enc.anchor,
                        enc.residual if residual or seg.protected else None,
                        config=config,
                        shape=part.shape,
                        dtype=part.dtype,
                        kind=kind,  # type: ignore[arg-type]
                    )
                )
            dest.append(torch.cat(pieces))
    return out


def assert_rows_equal(
    got: tuple[list[torch.Tensor], list[torch.Tensor]], want: tuple[list[torch.Tensor], list[torch.Tensor]]
) -> None:
    """Bit for bit (so -0.0 and +0.0 differ)."""
    for name, got_layers, want_layers in (("K", got[0], want[0]), ("V", got[1], want[1])):
        for layer, (g, w) in enumerate(zip(got_layers, want_layers, strict=True)):
            assert torch.equal(g.view(torch.int16), w.view(torch.int16)), f"{name} layer {layer} differs"


# ---- helpers -----------------------------------------------------------------------------------


def test_page_slots() -> None:
    pages = np.array([3, 0, 5])
    assert page_slots(pages, 1).tolist() == [3, 0, 5]
    assert page_slots(pages, 4).tolist() == [12, 13, 14, 15, 0, 1, 2, 3, 20, 21, 22, 23]
    assert page_slots(torch.tensor([2]), 2).dtype == torch.int64
    assert page_slots(np.array([], dtype=np.int64), 4).numel() == 0


def test_buffers_must_be_flat_uint8(pairs: Callable[..., Pair]) -> None:
    pair = pairs()
    with pytest.raises(ValueError, match="receive buffer"):
        ProgressiveReceiver(
            buffer=torch.zeros(64, dtype=torch.float32),
            k_buffers=pair.decode_k,
            v_buffers=pair.decode_v,
            handshake=pair.handshake,
            deadline_s=1.0,
        )
    with pytest.raises(ValueError, match="send buffer"):
        ProgressiveSender(
            backend=CopyBackend(),
            buffer=torch.zeros(8, 8, dtype=torch.uint8),
            k_buffers=pair.prefill_k,
            v_buffers=pair.prefill_v,
            page_size=1,
            handshake=pair.handshake,
            lane_config=LaneConfig(),
            notify=lambda endpoint, frames: None,
            on_failure=lambda room, reason: None,
        )


# ---- the whole path ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("page_size", "chunks"),
    [
        (1, [100, 300, 200]),  # a segment completes inside the second chunk
        (1, [600]),
        (4, [64, 64, 22]),  # 150 pages of 4 cover 600 tokens
        (8, [40, 35]),  # 75 pages of 8, the last one partial (598 tokens)
    ],
)
@pytest.mark.parametrize("checksums", [False, True])
def test_full_mode_decodes_the_codec_reconstruction(
    pairs: Callable[..., Pair], page_size: int, chunks: list[int], checksums: bool
) -> None:
    n_tokens = N_TOKENS if page_size != 8 else N_TOKENS - 2
    pair = pairs(page_size=page_size, checksums=checksums)
    offer = pair.offer(room=11, n_tokens=n_tokens)
    plan = RequestLayout(LAYOUT, pair.handshake.codec, n_tokens, Mode.FULL)
    assert (offer.anchor_nbytes, offer.residual_nbytes, offer.n_tokens) == (
        plan.anchor_nbytes,
        plan.residual_nbytes,
        n_tokens,
    )
    assert pair.kinds(11) == [NoticeKind.ACCEPT]
    pages = pair.pages(seed=1, n_tokens=n_tokens)
    pair.send(11, offer, pages, chunks)
    assert not pair.sender.holds_pages(11)
    assert pair.wait_verdict(11, Verdict.READY) is None

    dst = page_slots(pair.pages(seed=2, n_tokens=n_tokens), page_size)[:n_tokens]  # other rows
    pair.receiver.write_kv(11, dst)
    src = page_slots(pages, page_size)[:n_tokens]
    want = reference_rows(pair.prefill_rows(src), pair.handshake.codec, residual=True)
    assert_rows_equal(pair.decode_rows(dst), want)
    untouched = torch.ones(ROWS, dtype=torch.bool)
    untouched[dst] = False
    assert all(not k[untouched].any() for k in pair.decode_k)

    report = pair.receiver.forget(11)
    assert report is not None
    sent = travelled(pair, src)
    assert sent[Stream.RESIDUAL] < plan.residual_nbytes  # the lossless Residual codes short
    assert (report.anchor_bytes, report.residual_bytes) == (sent[Stream.ANCHOR], sent[Stream.RESIDUAL])
    assert report.anchor_latency_s is not None and report.anchor_latency_s >= 0
    assert report.residual_latency_s is not None and report.residual_latency_s >= 0
    assert pair.receiver.forget(11) is None
    assert pair.receiver.stats().buffer_used == 0  # complete: no write can still arrive

    pair.wait_released(11)
    assert pair.settling(11) == [NoticeKind.ACCEPT, NoticeKind.LANDED, NoticeKind.LANDED, NoticeKind.RELEASED]
    segments = len(plan.segments) if checksums else 0  # one checksum per segment and stream, if on
    assert [len(n.checksums) for n in pair.notices if n.kind is NoticeKind.LANDED] == [segments, segments]
    wait_for(lambda: pair.sender.stats().rooms == 0, "the sender to forget the room")
    stats = pair.sender.stats()
    assert (stats.buffer_used, stats.waiting_for_space) == (0, 0)
    assert (stats.anchor_bytes, stats.residual_bytes) == (sent[Stream.ANCHOR], sent[Stream.RESIDUAL])
    got = pair.receiver.stats()
    assert (got.rooms, got.quarantined, got.buffer_used) == (0, 0, 0)
    assert (got.anchor_bytes, got.residual_bytes) == (sent[Stream.ANCHOR], sent[Stream.RESIDUAL])
    # every byte went into the space decode offered
    for t in pair.backend.written():
        assert offer.anchor_addr <= t.dst and t.dst + t.length <= offer.residual_addr + offer.residual_nbytes


def test_released_never_overtakes_a_landed_notice(pairs: Callable[..., Pair]) -> None:
    pair = pairs(landed_delay_s=0.1)  # several reaper rounds per LANDED
    offer = pair.offer(room=21)
    pair.send(21, offer, pair.pages(seed=20), [600])
    assert pair.wait_verdict(21, Verdict.READY) is None
    pair.wait_released(21)
    assert pair.settling(21) == [NoticeKind.ACCEPT, NoticeKind.LANDED, NoticeKind.LANDED, NoticeKind.RELEASED]


def test_exact_residual_is_bit_exact_with_the_prefill_rows(pairs: Callable[..., Pair]) -> None:
    pair = pairs(codec=CodecConfig(residual="exact"), page_size=4)
    offer = pair.offer(room=5)
    pages = pair.pages(seed=3)
    pair.send(5, offer, pages, [70, 80])
    pair.wait_verdict(5, Verdict.READY)
    dst = torch.arange(1000, 1000 + N_TOKENS)
    pair.receiver.write_kv(5, dst)
    pair.receiver.write_kv(5, dst)  # once only: a second call is a no-op
    assert_rows_equal(pair.decode_rows(dst), pair.prefill_rows(page_slots(pages, 4)[:N_TOKENS]))


def test_anchor_only_sends_no_residual_and_decodes_the_anchor(pairs: Callable[..., Pair]) -> None:
    pair = pairs(mode="anchor-only")
    offer = pair.offer(room=9)
    plan = RequestLayout(LAYOUT, pair.handshake.codec, N_TOKENS, Mode.FULL)
    assert (offer.anchor_nbytes, offer.residual_addr, offer.residual_nbytes) == (plan.anchor_nbytes, 0, 0)
    pages = pair.pages(seed=4)
    pair.send(9, offer, pages, [300, 300])
    pair.wait_verdict(9, Verdict.READY)
    dst = torch.arange(N_TOKENS)
    pair.receiver.write_kv(9, dst)
    want = reference_rows(pair.prefill_rows(page_slots(pages, 1)), pair.handshake.codec, residual=False)
    assert_rows_equal(pair.decode_rows(dst), want)

    report = pair.receiver.forget(9)
    assert report is not None and (report.anchor_bytes, report.residual_bytes) == (plan.anchor_nbytes, 0)
    pair.wait_released(9)
    landed = [n for n in pair.notices if n.kind is NoticeKind.LANDED]
    assert [(n.stream, n.ok, n.nbytes) for n in landed] == [(Stream.ANCHOR, True, plan.anchor_nbytes)]
    assert sum(t.length for t in pair.backend.written()) == plan.anchor_nbytes
    for t in pair.backend.written():
        assert offer.anchor_addr <= t.dst and t.dst + t.length <= offer.anchor_addr + offer.anchor_nbytes
    wait_for(lambda: pair.sender.stats().buffer_used == 0, "the send buffer to empty")
    assert pair.sender.stats().residual_bytes == 0
    assert (pair.receiver.stats().residual_bytes, pair.receiver.stats().buffer_used) == (0, 0)


def test_speculative_decodes_the_anchor_then_refines_in_place(pairs: Callable[..., Pair]) -> None:
    pair = pairs(mode="speculative", residual_hold_s=2.0)
    offer = pair.offer(room=13)
    pages = pair.pages(seed=9)
    pair.send(13, offer, pages, [N_TOKENS])
    pair.wait_verdict(13, Verdict.READY)  # the Anchor is enough to start
    dst = torch.arange(N_TOKENS)
    assert pair.receiver.residual_verdict(13)[0] is Verdict.WAIT
    so_far = pair.receiver.report(13)
    assert so_far is not None and so_far.anchor_bytes > 0 and so_far.residual_bytes == 0
    assert pair.receiver.write_kv(13, dst) is False
    assert pair.receiver.write_kv(13, dst) is False  # nothing new landed: no rewrite
    rows = pair.prefill_rows(torch.as_tensor(pages))
    assert_rows_equal(pair.decode_rows(dst), reference_rows(rows, CodecConfig(), residual=False))
    wait_for(lambda: pair.receiver.residual_verdict(13)[0] is Verdict.READY, "the Residual")
    assert pair.receiver.write_kv(13, dst) is True  # refined in place
    assert_rows_equal(pair.decode_rows(dst), reference_rows(rows, CodecConfig(), residual=True))
    assert pair.receiver.write_kv(13, dst) is True
    report = pair.receiver.forget(13)
    assert report is not None and report.residual_latency_s is not None and report.residual_latency_s >= 2.0
    assert pair.receiver.stats().buffer_used == 0


def test_the_last_chunks_residual_waits_for_the_next_pump_its_anchor_does_not(
    pairs: Callable[..., Pair],
) -> None:
    """Upstream sends the first token once add_chunk returns: the last chunk's Anchor goes
    (with its stream's end) and decode may start, while its Residual is encoded on the
    next pump (the server's next poll), its pages held till then."""
    pair = pairs(mode="speculative", checksums=True)
    offer = pair.offer(room=15)
    pages = pair.pages(seed=15)
    pair.sender.add_chunk(15, pages[:300], False)  # an earlier chunk's Residual goes at once
    pair.sender.add_chunk(15, pages[300:], True)
    assert pair.sender.holds_pages(15)
    pair.wait_verdict(15, Verdict.READY)  # the whole Anchor landed
    plan = RequestLayout(LAYOUT, pair.handshake.codec, N_TOKENS, Mode.SPECULATIVE)
    src = page_slots(pages, pair.page_size)[:N_TOKENS]
    counts = plan.residual_nbytes_in(encoded_space(pair, src, pair.handshake.codec)[1])
    assert counts is not None
    first = sum(n or 0 for seg, n in zip(plan.segments, counts, strict=True) if seg.end <= 300)
    assert 0 < first < sum(n or 0 for n in counts)
    assert pair.sender.stats().residual_bytes == first  # the first chunk's Residual, no more
    wait_for(
        lambda: bytes_written_into(pair, offer.residual_addr, offer.residual_nbytes) == first,
        "the first chunk's Residual",
    )
    assert pair.receiver.residual_verdict(15)[0] is Verdict.WAIT

    pair.sender.pump()
    assert not pair.sender.holds_pages(15)
    wait_for(lambda: pair.receiver.residual_verdict(15)[0] is Verdict.READY, "the Residual")
    dst = torch.arange(N_TOKENS)
    assert pair.receiver.write_kv(15, dst) is True
    assert_rows_equal(pair.decode_rows(dst), pair.prefill_rows(src))  # lossless: bit for bit


def test_the_residual_lands_layer_by_layer_and_decode_refines_the_layers_that_landed(
    pairs: Callable[..., Pair],
) -> None:
    """Prefill sends every segment's Residual of layer 0, then of layer 1, ...; once the
    first layers landed, decode hears LAYERS and write_kv refines exactly those layers
    (the others keep the Anchor's values); once the whole Residual landed, the rest."""
    pair = pairs(mode="speculative", checksums=True)
    offer = pair.offer(room=17)
    pages = pair.pages(seed=17)
    src = page_slots(pages, pair.page_size)[:N_TOKENS]
    plan, space = encoded_space(pair, src, pair.handshake.codec)
    residual_at = offer.residual_addr - plan.region_offset(Stream.RESIDUAL)
    layer_of: list[tuple[int, int, int]] = []  # (first byte, end, layer) on decode's side
    for seg in plan.segments:
        residual = space[plan.byte_ranges(seg)[1]]
        ends = residual_layer_ends(residual, seg.end - seg.start, LAYOUT, pair.handshake.codec)
        start = residual_at + plan.byte_ranges(seg)[1].start
        for layer, (first, end) in enumerate(itertools.pairwise([0, *ends])):
            layer_of.append((start + first, start + end, layer))

    def layer(t: Transfer) -> int | None:
        return next((n for first, end, n in layer_of if first <= t.dst < end), None)

    pair.backend.lands = lambda t: (layer(t) or 0) < 2  # the Anchor, and layers 0 and 1
    pair.sender.add_chunk(17, pages, True)
    pair.wait_verdict(17, Verdict.READY)
    dst = torch.arange(N_TOKENS)
    assert pair.receiver.write_kv(17, dst) is False  # the Anchor
    pair.sender.pump()

    def heard() -> list[int]:
        with pair.lock:
            return [n.layers for n in pair.notices if n.kind is NoticeKind.LAYERS]

    wait_for(lambda: 2 in heard(), "LAYERS of 2 layers")
    assert heard() in ([1, 2], [2])  # each part that lands, or both in one pass of the lanes
    assert pair.receiver.residual_verdict(17)[0] is Verdict.WAIT
    # a landed layer's bytes are checked against their own checksum before any row is written
    first, end, _ = next(entry for entry in layer_of if entry[2] == 1)
    byte = (first + end) // 2 - pair.receive_buffer.data_ptr()
    pair.receive_buffer[byte] ^= 1
    before = pair.decode_rows(dst)
    with pytest.raises(ReceiveIntegrityError, match=r"Residual bytes of layer 1 of tokens \[0, 256\)"):
        pair.receiver.write_kv(17, dst)
    assert_rows_equal(pair.decode_rows(dst), before)
    pair.receive_buffer[byte] ^= 1
    assert pair.receiver.write_kv(17, dst) is False
    exact = pair.prefill_rows(src)
    anchor_only = reference_rows(exact, pair.handshake.codec, residual=False)
    got = pair.decode_rows(dst)
    assert_rows_equal(
        got, tuple([*kind[:2], *anchor[2:]] for kind, anchor in zip(exact, anchor_only, strict=True))
    )
    assert pair.receiver.write_kv(17, dst) is False  # nothing new landed: nothing written

    pair.backend.lands = None
    wait_for(lambda: pair.receiver.residual_verdict(17)[0] is Verdict.READY, "the Residual")
    assert pair.receiver.write_kv(17, dst) is True
    assert_rows_equal(pair.decode_rows(dst), exact)  # lossless: bit for bit
    pair.receiver.forget(17)
    pair.wait_released(17)
    assert pair.settling(17) == [NoticeKind.ACCEPT, NoticeKind.LANDED, NoticeKind.LANDED, NoticeKind.RELEASED]


def test_kv_changed_between_its_anchor_and_its_residual_fails_the_room(pairs: Callable[..., Pair]) -> None:
    """A Residual codes the KV against the Anchor that left: if the pages changed in
    between, prefill fails the request instead of sending bytes that decode wrong."""
    pair = pairs(mode="speculative")
    pair.offer(room=16)
    pages = pair.pages(seed=16)
    pair.sender.add_chunk(16, pages, True)
    pair.wait_verdict(16, Verdict.READY)  # the Anchor that left is sound
    slot = int(page_slots(pages, pair.page_size)[5])
    pair.prefill_k[3][slot] += 1.0
    pair.sender.pump()
    assert not pair.sender.holds_pages(16)
    assert pair.failures and pair.failures[-1][0] == 16
    assert "the KV changed after its Anchor left" in pair.failures[-1][1]
    wait_for(lambda: pair.receiver.residual_verdict(16)[0] is not Verdict.WAIT, "decode to hear")
    assert pair.receiver.residual_verdict(16)[0] is Verdict.FAIL


# ---- protected tokens --------------------------------------------------------------------------

PROTECT = (20, 70)  # tokens [0, 32) and [528, 600): whole key blocks of 16


def protected_mask(plan: RequestLayout) -> torch.Tensor:
    return torch.tensor([s.protected for s in plan.segments for _ in range(s.start, s.end)])


def travelled(pair: Pair, slots: torch.Tensor) -> dict[Stream, int]:
    """The bytes a transfer of the tokens at prefill's ``slots`` puts on each stream: as
    many as the request's space holds, less what its lossless Residuals did not take."""
    plan, space = encoded_space(pair, torch.as_tensor(slots), pair.handshake.codec)
    counts = plan.residual_nbytes_in(space)
    sent = {stream: 0 for stream in Stream}
    for stream in plan.streams:
        sent[stream] = sum(span.stop - span.start for _, span in plan.stream_ranges(stream, counts))
    return sent


def bytes_written_into(pair: Pair, addr: int, nbytes: int) -> int:
    return sum(
        t.length for t in pair.backend.written() if addr <= t.dst and t.dst + t.length <= addr + nbytes
    )


@pytest.mark.parametrize("residual", ["int8", "exact"])
def test_protected_tokens_are_full_precision_once_the_anchor_lands(
    pairs: Callable[..., Pair], residual: str
) -> None:
    codec = CodecConfig(residual=residual)  # type: ignore[arg-type]
    pair = pairs(mode="speculative", codec=codec, protect=PROTECT, residual_hold_s=1.0)
    plan = RequestLayout.of(pair.handshake, N_TOKENS)
    protected = protected_mask(plan)
    assert (plan.protect_until, plan.protect_from, plan.protected_tokens) == (32, 528, 104)
    offer = pair.offer(room=31)
    assert (offer.anchor_nbytes, offer.residual_nbytes) == (plan.anchor_nbytes, plan.residual_nbytes)
    pages = pair.pages(seed=23)
    pair.send(31, offer, pages, [100, 300, 200])  # the first chunk completes only [0, 32)
    pair.wait_verdict(31, Verdict.READY)
    assert pair.receiver.residual_verdict(31)[0] is Verdict.WAIT
    dst = torch.arange(N_TOKENS)
    assert pair.receiver.write_kv(31, dst) is False  # the unprotected rows are Anchor-only

    rows = pair.prefill_rows(torch.as_tensor(pages))
    on_anchor = pair.decode_rows(dst)
    assert_rows_equal(on_anchor, reference_rows(rows, codec, residual=False, protect=PROTECT))
    if residual == "exact":  # the draft decodes on the prefill's own values there
        assert_rows_equal(
            ([k[protected] for k in on_anchor[0]], [v[protected] for v in on_anchor[1]]),
            ([k[protected] for k in rows[0]], [v[protected] for v in rows[1]]),
        )
    # the unprotected rows are what they would be with nothing protected
    plain = reference_rows(rows, codec, residual=False)
    assert_rows_equal(
        ([k[~protected] for k in on_anchor[0]], [v[~protected] for v in on_anchor[1]]),
        ([k[~protected] for k in plain[0]], [v[~protected] for v in plain[1]]),
    )

    wait_for(lambda: pair.receiver.residual_verdict(31)[0] is Verdict.READY, "the Residual")
    assert pair.receiver.write_kv(31, dst) is True  # refined in place
    assert_rows_equal(pair.decode_rows(dst), reference_rows(rows, codec, residual=True))
    if residual == "exact":
        assert_rows_equal(pair.decode_rows(dst), rows)
    report = pair.receiver.forget(31)
    sent = travelled(pair, torch.as_tensor(pages))
    assert report is not None and (report.anchor_bytes, report.residual_bytes) == (
        sent[Stream.ANCHOR],
        sent[Stream.RESIDUAL],
    )
    assert pair.receiver.stats().buffer_used == 0
    pair.wait_released(31)
    # every travelling byte sent once: protected Residuals in the Anchor region, on HIGH
    assert sum(t.length for t in pair.backend.written()) == sent[Stream.ANCHOR] + sent[Stream.RESIDUAL]
    assert bytes_written_into(pair, offer.anchor_addr, offer.anchor_nbytes) == sent[Stream.ANCHOR]
    assert bytes_written_into(pair, offer.residual_addr, offer.residual_nbytes) == sent[Stream.RESIDUAL]
    landed = [(n.stream, n.nbytes) for n in pair.notices if n.kind is NoticeKind.LANDED]
    assert sorted(landed) == [(Stream.ANCHOR, sent[Stream.ANCHOR]), (Stream.RESIDUAL, sent[Stream.RESIDUAL])]
    if residual == "int8":
        assert sent == {Stream.ANCHOR: plan.anchor_nbytes, Stream.RESIDUAL: plan.residual_nbytes}


def test_anchor_only_sends_protected_tokens_at_full_precision(pairs: Callable[..., Pair]) -> None:
    pair = pairs(mode="anchor-only", protect=PROTECT)
    plan = RequestLayout.of(pair.handshake, N_TOKENS)
    offer = pair.offer(room=32)
    assert (offer.anchor_nbytes, offer.residual_addr, offer.residual_nbytes) == (plan.anchor_nbytes, 0, 0)
    pages = pair.pages(seed=24)
    pair.send(32, offer, pages, [N_TOKENS])
    pair.wait_verdict(32, Verdict.READY)
    dst = torch.arange(N_TOKENS)
    assert pair.receiver.write_kv(32, dst) is False
    want = reference_rows(
        pair.prefill_rows(torch.as_tensor(pages)), CodecConfig(), residual=False, protect=PROTECT
    )
    assert_rows_equal(pair.decode_rows(dst), want)
    assert pair.receiver.write_kv(32, dst) is False  # nothing more will come
    pair.receiver.forget(32)
    pair.wait_released(32)
    sent = travelled(pair, torch.as_tensor(pages))
    assert sent[Stream.ANCHOR] < plan.anchor_nbytes  # the protected tokens' lossless Residuals
    assert sum(t.length for t in pair.backend.written()) == sent[Stream.ANCHOR]
    landed = [(n.stream, n.nbytes) for n in pair.notices if n.kind is NoticeKind.LANDED]
    assert landed == [(Stream.ANCHOR, sent[Stream.ANCHOR])]
    assert pair.receiver.stats().buffer_used == 0


@pytest.mark.parametrize("mode", ["full", "speculative"])
def test_every_token_protected_sends_the_anchor_stream_alone(pairs: Callable[..., Pair], mode: Mode) -> None:
    pair = pairs(mode=mode, codec=CodecConfig(residual="exact"), protect=(300, 300))
    plan = RequestLayout.of(pair.handshake, N_TOKENS)
    assert plan.protects_all and plan.streams == (Stream.ANCHOR,)
    offer = pair.offer(room=33)
    assert (offer.anchor_nbytes, offer.residual_addr, offer.residual_nbytes) == (plan.encoded_nbytes, 0, 0)
    pages = pair.pages(seed=25)
    pair.send(33, offer, pages, [200, 400])
    pair.wait_verdict(33, Verdict.READY)
    assert pair.receiver.residual_verdict(33)[0] is Verdict.READY  # nothing left to wait for
    dst = torch.arange(N_TOKENS)
    assert pair.receiver.write_kv(33, dst) is True  # full precision at once: no speculation
    assert_rows_equal(pair.decode_rows(dst), pair.prefill_rows(torch.as_tensor(pages)))
    pair.receiver.forget(33)
    assert pair.receiver.stats().buffer_used == 0  # complete: no write can still arrive
    pair.wait_released(33)
    assert pair.kinds(33) == [NoticeKind.ACCEPT, NoticeKind.LANDED, NoticeKind.RELEASED]
    stats = pair.sender.stats()
    assert (stats.anchor_bytes, stats.residual_bytes) == (
        travelled(pair, torch.as_tensor(pages))[Stream.ANCHOR],
        0,
    )
    assert stats.anchor_bytes < plan.encoded_nbytes


def test_other_protection_on_decode_is_refused(pairs: Callable[..., Pair]) -> None:
    pair = pairs(protect=PROTECT, decode_protect=(0, 64))
    offer = pair.reserve(34)
    assert offer is not None
    reason = pair.answer(34, offer.to_wire())
    assert isinstance(reason, str)
    assert "protect_first=20 protect_last=70" in reason and "protect_first=0 protect_last=64" in reason
    assert (
        pair.wait_verdict(34, Verdict.FAIL) == f"prefill {PREFILL_ADDR} refused the Lynx transfer: {reason}"
    )


def test_two_requests_at_once_land_in_their_own_space(pairs: Callable[..., Pair]) -> None:
    pair = pairs()
    offers = {room: pair.offer(room) for room in (1, 2)}
    pages = {1: pair.pages(seed=5), 2: pair.pages(seed=6)}
    # interleaved chunks
    pair.chunk(1, offers[1], pages[1][:300], False)
    pair.chunk(2, offers[2], pages[2][:400], False)
    pair.chunk(2, offers[2], pages[2][400:], True)
    pair.chunk(1, offers[1], pages[1][300:], True)
    for room, base in ((1, 0), (2, N_TOKENS)):
        pair.wait_verdict(room, Verdict.READY)
        dst = torch.arange(base, base + N_TOKENS)
        pair.receiver.write_kv(room, dst)
        want = reference_rows(pair.prefill_rows(torch.as_tensor(pages[room])), CodecConfig(), residual=True)
        assert_rows_equal(pair.decode_rows(dst), want)


# ---- space ------------------------------------------------------------------------------------


def test_a_full_send_buffer_makes_the_next_request_wait(pairs: Callable[..., Pair]) -> None:
    one = request_nbytes(Handshake("full", CodecConfig(), LAYOUT))
    pair = pairs(send_bytes=one + one // 2)
    offers = {room: pair.offer(room) for room in (1, 2)}
    pages = {1: pair.pages(seed=7), 2: pair.pages(seed=8)}
    pair.chunk(1, offers[1], pages[1][:100], False)  # room 1 takes its space
    assert not pair.sender.holds_pages(1)
    pair.send(2, offers[2], pages[2], [600])
    assert pair.sender.holds_pages(2)
    stats = pair.sender.stats()
    assert (stats.rooms, stats.waiting_for_space) == (2, 1)
    pair.sender.pump()
    assert pair.sender.holds_pages(2)
    assert pair.kinds(2) == [NoticeKind.ACCEPT]

    pair.chunk(1, offers[1], pages[1][100:], True)
    pair.wait_verdict(1, Verdict.READY)
    pair.wait_released(1)

    def proceeds() -> bool:
        pair.sender.pump()  # what the server's poll loop does
        return not pair.sender.holds_pages(2)

    wait_for(proceeds, "room 2 to get send space")
    pair.wait_verdict(2, Verdict.READY)
    dst = torch.arange(N_TOKENS)
    pair.receiver.write_kv(2, dst)
    want = reference_rows(pair.prefill_rows(torch.as_tensor(pages[2])), CodecConfig(), residual=True)
    assert_rows_equal(pair.decode_rows(dst), want)


def test_a_request_larger_than_the_send_buffer_fails_instead_of_blocking(pairs: Callable[..., Pair]) -> None:
    small = request_nbytes(Handshake("full", CodecConfig(), LAYOUT), n_tokens=256)
    pair = pairs(send_bytes=small)
    big, fits = pair.offer(1), pair.offer(2, n_tokens=256)
    pair.send(1, big, pair.pages(seed=21), [600])
    assert len(pair.failures) == 1
    room, reason = pair.failures[0]
    assert room == 1 and "--lynx-buffer-bytes" in reason
    assert not pair.sender.holds_pages(1)
    pair.send(2, fits, pair.pages(seed=22, n_tokens=256), [256])  # the next request is not held up
    pair.wait_verdict(2, Verdict.READY)


def test_a_full_receive_buffer_makes_reserve_wait(pairs: Callable[..., Pair]) -> None:
    one = request_nbytes(Handshake("full", CodecConfig(), LAYOUT))
    pair = pairs(recv_bytes=one + one // 2)
    offer = pair.offer(1)
    assert pair.reserve(2) is None
    assert pair.receiver.reserve(2) is None  # polled again: still no space
    stats = pair.receiver.stats()
    assert (stats.rooms, stats.waiting_for_space, stats.buffer_used) == (2, 1, one)
    assert pair.receiver.report(2) is not None
    assert pair.receiver.verdict(2, AuxStatus.PENDING) == (Verdict.WAIT, None)

    pair.send(1, offer, pair.pages(seed=9), [600])
    pair.wait_verdict(1, Verdict.READY)
    pair.receiver.write_kv(1, torch.arange(N_TOKENS))
    pair.receiver.forget(1)
    again = pair.receiver.reserve(2)
    assert again is not None and again.anchor_addr == offer.anchor_addr
    assert pair.receiver.reserve(2) == again  # the same reservation


def test_a_request_larger_than_the_receive_buffer_fails_at_once(pairs: Callable[..., Pair]) -> None:
    one = request_nbytes(Handshake("full", CodecConfig(), LAYOUT))
    pair = pairs(recv_bytes=one // 2)
    with pytest.raises(ReceiveCapacityError, match="--lynx-buffer-bytes"):
        pair.receiver.register(1, N_TOKENS, peer=PREFILL_ADDR)
    assert pair.receiver.report(1) is None
    assert pair.receiver.stats().rooms == 0


def test_decode_needs_one_slot_per_token(pairs: Callable[..., Pair]) -> None:
    pair = pairs(mode="anchor-only")
    offer = pair.offer(3)
    pair.send(3, offer, pair.pages(seed=10), [600])
    pair.wait_verdict(3, Verdict.READY)
    with pytest.raises(ValueError, match="599 KV slots for 600 tokens"):
        pair.receiver.write_kv(3, torch.arange(N_TOKENS - 1))


def test_verdict_of_an_unknown_room_fails(pairs: Callable[..., Pair]) -> None:
    pair = pairs()
    assert pair.receiver.verdict(404, AuxStatus.SUCCESS) == (Verdict.FAIL, "no Lynx state for room 404")
    assert pair.receiver.report(404) is None


def test_unreadable_notices_and_unknown_rooms_are_dropped_and_counted(pairs: Callable[..., Pair]) -> None:
    pair = pairs()
    offer = pair.offer(17)
    pair.receiver.on_notice([b"LYNX1", b"HELLO", bytes(8)])
    pair.receiver.on_notice(Notice(NoticeKind.LANDED, 17, offer.nonce, nbytes=5).to_frames()[:2])
    pair.receiver.on_notice(Notice(NoticeKind.REJECT, 99, offer.nonce, text="not yours").to_frames())
    pair.receiver.on_notice(Notice(NoticeKind.RELEASED, 98, offer.nonce).to_frames())
    assert pair.receiver.verdict(17, AuxStatus.PENDING) == (Verdict.WAIT, None)
    stats = pair.receiver.stats()
    assert (stats.rooms, stats.anchor_bytes, stats.residual_bytes) == (1, 0, 0)
    assert stats.dropped_notices == {"malformed": 2, "unknown_reservation": 2}
    assert pair.dropped == ["malformed", "malformed", "unknown_reservation", "unknown_reservation"]


# ---- failures ----------------------------------------------------------------------------------


def test_a_failing_write_fails_the_receiver_and_calls_on_failure(pairs: Callable[..., Pair]) -> None:
    pair = pairs(backend=CopyBackend(fail_batch=0))
    offer = pair.offer(4)
    pair.chunk(4, offer, pair.pages(seed=11), True)  # the first batch is the Anchor (HIGH)
    reason = pair.wait_verdict(4, Verdict.FAIL)
    lane_error = "HIGH write to decode:1 failed in the engine"
    assert reason == f"prefill {PREFILL_ADDR} could not deliver the Anchor: {lane_error}"
    pair.receiver.forget(4)
    pair.wait_released(4)
    assert pair.failures == [(4, f"Lynx HIGH lane: {lane_error}")]  # once, though both lanes failed
    sent = pair.sender.stats()
    pair.chunk(4, offer, pair.pages(seed=11), False)  # a late chunk starts nothing
    assert pair.sender.stats() == sent
    assert not pair.sender.holds_pages(4)
    wait_for(lambda: pair.sender.stats().buffer_used == 0, "the send buffer to empty")
    assert pair.receiver.stats().buffer_used == 0
    assert pair.receiver.stats().quarantined == 0


def test_nan_in_the_kv_fails_naming_the_layer(pairs: Callable[..., Pair]) -> None:
    pair = pairs()
    offer = pair.offer(6)
    pages = pair.pages(seed=12)
    pair.prefill_k[2][int(pages[300])] = float("nan")  # token 300: the second segment
    pair.send(6, offer, pages, [600])
    assert len(pair.failures) == 1  # at once, on the caller's thread
    room, reason = pair.failures[0]
    assert room == 6
    assert "layer 2" in reason and "cannot encode the KV of room 6" in reason
    assert not pair.sender.holds_pages(6)
    # prefill gives the room up: decode hears RELEASED and fails the request
    pair.wait_released(6)
    reason = pair.wait_verdict(6, Verdict.FAIL)
    assert reason == f"prefill {PREFILL_ADDR} gave the request up before it landed"
    pair.receiver.forget(6)
    assert pair.receiver.stats().buffer_used == 0
    wait_for(lambda: pair.sender.stats().buffer_used == 0, "the send buffer to empty")


def test_checksums_on_one_side_only_are_refused(pairs: Callable[..., Pair]) -> None:
    pair = pairs(checksums=True, decode_checksums=False)
    offer = pair.reserve(7)
    assert offer is not None
    reason = pair.answer(7, offer.to_wire())
    assert isinstance(reason, str)
    assert "this prefill server (mode=full" in reason and "checksums=on" in reason
    assert "decode 10.0.0.2:9000 (mode=full" in reason and "checksums=off" in reason
    assert pair.wait_verdict(7, Verdict.FAIL) == f"prefill {PREFILL_ADDR} refused the Lynx transfer: {reason}"


def test_other_settings_on_decode_are_refused(pairs: Callable[..., Pair]) -> None:
    pair = pairs(decode_codec=CodecConfig(anchor_bits=3))
    offer = pair.reserve(8)
    assert offer is not None
    reason = pair.answer(8, offer.to_wire())
    assert isinstance(reason, str)
    assert "anchor_bits=4" in reason and "anchor_bits=3" in reason and "decode 10.0.0.2:9000" in reason
    assert pair.kinds(8) == [NoticeKind.REJECT]
    verdict, error = pair.verdict(8)
    assert verdict is Verdict.FAIL
    assert error == f"prefill {PREFILL_ADDR} refused the Lynx transfer: {reason}"


def test_unreadable_and_missing_offers_are_refused(pairs: Callable[..., Pair]) -> None:
    pair = pairs()
    reason = pair.answer(8, b"\x01")
    assert isinstance(reason, str) and reason.startswith("cannot read the decode server's Lynx offer")
    assert pair.kinds(8) == []  # no nonce to address a REJECT to: upstream's failure tells decode
    assert pair.sender.refusal(8) == reason
    bad_handshake = Offer(b"LXHS\x01\x00", 5, 64, 64, 128, 64, 1).to_wire()
    reason = pair.answer(9, bad_handshake)
    assert isinstance(reason, str) and reason.startswith("cannot read")
    assert "peer speaks Lynx protocol v1, this server v7" in reason
    assert [(n.kind, n.nonce) for n in pair.notices if n.room == 9] == [(NoticeKind.REJECT, 5)]
    reason = pair.answer(10, None)
    assert isinstance(reason, str) and "--lynx" in reason
    assert pair.kinds(10) == []  # a decode without Lynx would not understand a notice
    assert pair.sender.refusal(10) == reason
    assert "sent no Lynx offer" in (pair.sender.refusal(11) or "")  # no metadata came at all
    with pytest.raises(ValueError, match="no accepted Lynx offer"):
        pair.sender.add_chunk(10, pair.pages(seed=1), True)


def test_an_offer_of_the_wrong_size_is_refused(pairs: Callable[..., Pair]) -> None:
    pair = pairs()
    offer = pair.reserve(12)
    assert offer is not None
    plan = RequestLayout.of(pair.handshake, N_TOKENS)
    short = Offer(offer.handshake, offer.nonce, offer.anchor_addr, offer.anchor_nbytes - 64, 0, 0, N_TOKENS)
    reason = pair.answer(12, short.to_wire())
    assert reason == (
        f"decode 10.0.0.2:9000 offered {plan.anchor_nbytes - 64}+0 bytes for {N_TOKENS} tokens, "
        f"this side sends {plan.anchor_nbytes}+{plan.residual_nbytes}"
    )
    assert pair.kinds(12) == [NoticeKind.REJECT]
    assert (
        pair.wait_verdict(12, Verdict.FAIL) == f"prefill {PREFILL_ADDR} refused the Lynx transfer: {reason}"
    )
    with pytest.raises(ValueError, match="no accepted Lynx offer"):
        pair.sender.add_chunk(12, pair.pages(seed=13), True)
    assert pair.sender.stats().rooms == 0
    assert pair.backend.written() == []


def test_a_request_decode_holds_whole_sends_no_kv_and_refuses_any_offer(pairs: Callable[..., Pair]) -> None:
    """Decode's radix cache holds the whole prompt: prefill sizes the request at 0 tokens
    and sends no KV (upstream's aux data only); decode sends no offer, and one that comes
    anyway, of any size, 0 tokens included, is refused, never decoded as a layout."""
    pair = pairs()
    pair.sender.open_room(30)
    assert pair.sender.size_room(30, 0) is None
    assert pair.sender.sends_no_kv(30)
    assert not pair.sender.sends_no_kv(31)
    offer = pair.reserve(32)
    assert offer is not None
    for room, n_tokens in ((32, N_TOKENS), (33, 0)):
        sent = Offer(offer.handshake, offer.nonce, offer.anchor_addr, offer.anchor_nbytes, 0, 0, n_tokens)
        reason = pair.answer(room, sent.to_wire(), 0)
        assert reason == (
            f"decode 10.0.0.2:9000 offered space for {n_tokens} tokens, this prefill server's "
            "request sends none (decode's radix cache holds its whole prompt): no offer is due"
        )
        assert pair.kinds(room) == [NoticeKind.REJECT]
    assert pair.wait_verdict(32, Verdict.FAIL) is not None
    assert pair.sender.stats().rooms == 0
    assert pair.backend.written() == []


def test_fewer_tokens_than_offered_fail_the_room(pairs: Callable[..., Pair]) -> None:
    pair = pairs()
    offer = pair.offer(13)
    pair.send(13, offer, pair.pages(seed=14)[:500], [500])
    assert pair.failures == [(13, "prefill sent 500 tokens, decode expects 600")]
    pair.wait_released(13)
    assert pair.wait_verdict(13, Verdict.FAIL) is not None


# ---- aborts ------------------------------------------------------------------------------------


def test_abort_before_any_write_frees_both_sides(pairs: Callable[..., Pair]) -> None:
    pair = pairs()
    offer = pair.offer(14)
    pages = pair.pages(seed=15)
    pair.chunk(14, offer, pages[:100], False)  # not a whole segment yet: nothing sent
    assert pair.sender.stats().buffer_used > 0
    pair.sender.abort(14, "decode aborted the request")
    pair.wait_released(14)
    assert pair.kinds(14) == [NoticeKind.ACCEPT, NoticeKind.RELEASED]  # no LANDED for aborts
    wait_for(lambda: pair.sender.stats().buffer_used == 0, "the send buffer to empty")
    assert pair.sender.stats().rooms == 0
    assert pair.failures == []  # an abort is not a failure the server must report
    assert pair.verdict(14)[0] is Verdict.FAIL
    pair.receiver.forget(14)  # released: reused at once
    assert pair.receiver.stats().buffer_used == 0
    # later chunks of the aborted room are dropped: decode may have reused its space
    pair.chunk(14, offer, pages[100:400], False)
    assert not pair.sender.holds_pages(14)
    stats = pair.sender.stats()
    assert (stats.rooms, stats.buffer_used, stats.anchor_bytes, stats.residual_bytes) == (0, 0, 0, 0)


def test_abort_of_a_request_waiting_for_space(pairs: Callable[..., Pair]) -> None:
    one = request_nbytes(Handshake("full", CodecConfig(), LAYOUT))
    pair = pairs(send_bytes=one)
    offers = {room: pair.offer(room) for room in (1, 2, 3)}
    pair.chunk(1, offers[1], pair.pages(seed=16)[:100], False)
    pair.send(2, offers[2], pair.pages(seed=17), [600])
    pair.send(3, offers[3], pair.pages(seed=18), [600])
    assert pair.sender.stats().waiting_for_space == 2
    pair.sender.abort(2)
    assert not pair.sender.holds_pages(2)
    assert (pair.sender.stats().rooms, pair.sender.stats().waiting_for_space) == (2, 1)
    # Nothing of it was ever written: decode hears at once that it may reuse the space.
    assert pair.kinds(2) == [NoticeKind.ACCEPT, NoticeKind.RELEASED]
    pair.send(2, offers[2], pair.pages(seed=17), [600])  # a late chunk does not bring it back
    assert not pair.sender.holds_pages(2)
    assert pair.sender.stats().rooms == 2
    pair.sender.abort(1)
    pair.wait_released(1)

    def proceeds() -> bool:
        pair.sender.pump()
        return not pair.sender.holds_pages(3)

    wait_for(proceeds, "room 3 to get send space")
    pair.wait_verdict(3, Verdict.READY)


def test_space_is_kept_while_the_engine_holds_writes(pairs: Callable[..., Pair]) -> None:
    backend = CopyBackend(hold=True)
    pair = pairs(backend=backend)
    offer = pair.offer(15)
    pair.send(15, offer, pair.pages(seed=19), [600])
    wait_for(lambda: bool(backend.written()), "a write in the engine")
    pair.sender.abort(15)
    # decode gives the request up too: its space waits for RELEASED
    pair.receiver.forget(15)
    stats = pair.receiver.stats()
    assert (stats.quarantined, stats.buffer_used) == (1, request_nbytes(pair.handshake))
    time.sleep(0.1)  # several reaper rounds: the write in the engine pins the space
    assert NoticeKind.RELEASED not in pair.kinds(15)
    assert pair.sender.stats().buffer_used == request_nbytes(pair.handshake)

    backend.hold.clear()
    pair.wait_released(15)
    wait_for(lambda: pair.sender.stats().buffer_used == 0, "the send buffer to empty")
    stats = pair.receiver.stats()
    assert (stats.quarantined, stats.buffer_used) == (0, 0)


# ---- hostile or buggy peers --------------------------------------------------------------------


def forged(kind: NoticeKind, room: int, nonce: int, **fields: object) -> list[bytes]:
    return Notice(kind, room, nonce, **fields).to_frames()  # type: ignore[arg-type]


def complete(pair: Pair, room: int, seed: int) -> tuple[Offer, np.ndarray]:
    """A request of ``room`` sent, decoded and done with its receive space."""
    offer = pair.offer(room)
    pages = pair.pages(seed=seed)
    pair.send(room, offer, pages, [N_TOKENS])
    pair.wait_verdict(room, Verdict.READY)
    pair.receiver.write_kv(room, torch.arange(N_TOKENS))
    pair.receiver.forget(room)
    pair.wait_released(room)
    return offer, pages


def test_forged_landed_notices_cannot_make_a_request_decode_stale_bytes(pairs: Callable[..., Pair]) -> None:
    """Room 2 gets the space room 1 used; LANDED(0) notices without its nonce are dropped
    (old: two of them made room 2 complete, on room 1's bytes); one with its nonce but not
    the layout's byte count fails it."""
    pair = pairs()
    first, _ = complete(pair, 1, seed=30)
    offer = pair.offer(2)
    assert offer.anchor_addr == first.anchor_addr and offer.nonce != first.nonce
    for nonce in (0, first.nonce, offer.nonce ^ 1):
        for stream in (Stream.ANCHOR, Stream.RESIDUAL):
            pair.receiver.on_notice(forged(NoticeKind.LANDED, 2, nonce, stream=stream, nbytes=0))
    assert pair.verdict(2) == (Verdict.WAIT, None)
    assert pair.receiver.stats().dropped_notices == {"unknown_reservation": 6}
    report = pair.receiver.report(2)
    assert report is not None and (report.anchor_bytes, report.residual_bytes) == (0, 0)
    pair.receiver.on_notice(forged(NoticeKind.LANDED, 2, offer.nonce, stream=Stream.ANCHOR, nbytes=0))
    verdict, reason = pair.verdict(2)
    assert verdict is Verdict.FAIL
    assert reason == (
        f"prefill {PREFILL_ADDR} reported the Anchor landed with 0 bytes, "
        f"the request's layout sends {offer.anchor_nbytes}"
    )


def test_a_released_without_the_nonce_does_not_free_live_space(pairs: Callable[..., Pair]) -> None:
    """Old: a RELEASED naming a live room freed its space at once, and the real prefill's
    writes then landed in the next request's space."""
    pair = pairs(backend=CopyBackend(hold=True))
    offer = pair.offer(3)
    used = pair.receiver.stats().buffer_used
    pages = pair.pages(seed=31)
    pair.send(3, offer, pages, [N_TOKENS])
    for nonce in (0, offer.nonce + 1):
        pair.receiver.on_notice(forged(NoticeKind.RELEASED, 3, nonce))
    assert pair.receiver.stats().dropped_notices == {"unknown_reservation": 2}
    assert pair.verdict(3) == (Verdict.WAIT, None)
    pair.receiver.forget(3)  # e.g. the client aborts: the space stays quarantined
    assert (pair.receiver.stats().quarantined, pair.receiver.stats().buffer_used) == (1, used)
    assert pair.reserve(4) is not None
    assert pair.receiver.reserve(4).anchor_addr != offer.anchor_addr  # type: ignore[union-attr]
    pair.backend.hold.clear()  # the real prefill's writes land where they were meant to
    pair.wait_released(3)
    assert pair.receiver.stats().quarantined == 0


def test_notices_before_the_offer_or_while_waiting_for_space_are_dropped(pairs: Callable[..., Pair]) -> None:
    one = request_nbytes(Handshake("full", CodecConfig(), LAYOUT))
    pair = pairs(recv_bytes=one + one // 2)
    pair.receiver.on_notice(forged(NoticeKind.LANDED, 9, 0, nbytes=5))  # before any request of room 9
    first = pair.offer(1)
    assert pair.reserve(2) is None  # waiting for space: no nonce yet
    plan = RequestLayout.of(pair.handshake, N_TOKENS)
    for stream in (Stream.ANCHOR, Stream.RESIDUAL):
        n = len(plan.stream_ranges(stream))
        for nonce in (0, first.nonce):
            notice = forged(
                NoticeKind.LANDED,
                2,
                nonce,
                stream=stream,
                nbytes=plan.sent_nbytes()[stream],
                checksums=(0,) * n,
            )
            pair.receiver.on_notice(notice)
    pair.receiver.on_notice(forged(NoticeKind.ACCEPT, 2, 0, handshake=pair.handshake.to_wire()))
    assert pair.receiver.stats().dropped_notices == {"unknown_reservation": 6}
    pair.send(1, first, pair.pages(seed=32), [N_TOKENS])  # room 1 goes on untouched
    assert pair.wait_verdict(1, Verdict.READY) is None
    pair.receiver.write_kv(1, torch.arange(N_TOKENS))
    pair.receiver.forget(1)
    offer = pair.receiver.reserve(2)
    assert offer is not None
    # Old: the LANDED stored while waiting jumped the request to complete with the ACCEPT.
    assert pair.answer(2, offer.to_wire()) == offer
    assert pair.receiver.verdict(2, AuxStatus.SUCCESS) == (Verdict.WAIT, None)


def test_a_duplicate_room_fails_only_the_second_request(pairs: Callable[..., Pair]) -> None:
    one = request_nbytes(Handshake("full", CodecConfig(), LAYOUT))
    pair = pairs(recv_bytes=one + one // 2)
    offer = pair.offer(5)
    with pytest.raises(
        DuplicateRoomError, match=r"room 5 \(bootstrap_room\) is already taken by another request"
    ):
        pair.receiver.register(5, 300, peer="10.0.0.9:1")
    assert pair.reserve(6) is None  # waiting for space
    with pytest.raises(DuplicateRoomError):
        pair.receiver.register(6, N_TOKENS, peer=PREFILL_ADDR)
    assert pair.receiver.stats().rooms == 2
    pages = pair.pages(seed=33)
    pair.send(5, offer, pages, [N_TOKENS])  # the first request of the room is unaffected
    assert pair.wait_verdict(5, Verdict.READY) is None
    dst = torch.arange(N_TOKENS)
    pair.receiver.write_kv(5, dst)
    assert_rows_equal(
        pair.decode_rows(dst),
        reference_rows(pair.prefill_rows(torch.as_tensor(pages)), CodecConfig(), residual=True),
    )


def test_a_room_reused_after_an_abort_gets_its_own_reservation(pairs: Callable[..., Pair]) -> None:
    """Quarantine is kept per reservation: the old RELEASED (old nonce) frees the old space
    and leaves the room's new request alone; two quarantined reservations of one room are
    both kept. Old: the second overwrote the first (never freed), and the old RELEASED
    failed the new request."""
    pair = pairs(backend=CopyBackend(hold=True))
    old = pair.offer(15)
    pair.send(15, old, pair.pages(seed=34), [N_TOKENS])
    wait_for(lambda: bool(pair.backend.written()), "a write in the engine")
    pair.sender.abort(15)
    pair.receiver.forget(15)
    pair.sender.close_room(15)
    new = pair.reserve(15)
    assert new is not None and new.nonce != old.nonce and new.anchor_addr != old.anchor_addr
    assert pair.receiver.stats().quarantined == 1
    pair.receiver.forget(15)  # the new request is aborted too, before any answer
    assert pair.receiver.stats().quarantined == 2
    third = pair.reserve(15)
    assert third is not None
    pair.backend.hold.clear()
    pair.wait_released(15)  # the old reservation's, with its nonce
    wait_for(lambda: pair.receiver.stats().quarantined == 1, "the old quarantine to be freed")
    assert pair.receiver.verdict(15, AuxStatus.PENDING) == (Verdict.WAIT, None)
    wait_for(lambda: pair.sender.stats().rooms == 0, "prefill to let the old room go")
    assert pair.answer(15, third.to_wire()) == third
    pages = pair.pages(seed=35)
    pair.send(15, third, pages, [N_TOKENS])
    assert pair.wait_verdict(15, Verdict.READY) is None


def test_prefill_answers_offers_only_for_its_own_requests(pairs: Callable[..., Pair]) -> None:
    """Old: prefill answered any offer, for any room, at the address it named."""
    pair = pairs()
    offer = pair.reserve(20)
    assert offer is not None
    assert pair.sender.take_offer(20, offer.to_wire(), DECODE_ENDPOINT, DECODE_SESSION) is None
    assert pair.sender.take_offer(21, offer.to_wire(), DECODE_ENDPOINT, DECODE_SESSION) is None
    assert pair.kinds(20) == pair.kinds(21) == []
    assert pair.sender.stats().offers_waiting == 2
    pair.sender.open_room(20)  # the request exists, its length is not known yet
    assert pair.kinds(20) == []
    assert pair.sender.size_room(20, N_TOKENS) == offer
    assert pair.kinds(20) == [NoticeKind.ACCEPT] and pair.notices[-1].nonce == offer.nonce
    # an offer that comes after the request is sized is answered at once
    second = pair.reserve(22)
    assert second is not None
    pair.sender.open_room(22)
    assert pair.sender.size_room(22, N_TOKENS) is None
    assert pair.sender.take_offer(22, second.to_wire(), DECODE_ENDPOINT, DECODE_SESSION) == second
    # a second offer for a room is refused, saying why; the first answer stands, and the
    # same offer sent again is not answered twice
    assert pair.sender.take_offer(22, offer.to_wire(), DECODE_ENDPOINT, DECODE_SESSION) is None
    assert pair.sender.take_offer(22, second.to_wire(), DECODE_ENDPOINT, DECODE_SESSION) is None
    assert pair.kinds(22) == [NoticeKind.ACCEPT, NoticeKind.REJECT]
    assert pair.notices[-1].nonce == offer.nonce
    assert pair.notices[-1].text == "another offer for room 22 (bootstrap_room) came first"
    stats = pair.sender.stats()
    assert (stats.offers_waiting, stats.dropped_offers) == (1, {"duplicate": 2})
    assert pair.kinds(21) == []


def test_offers_for_rooms_without_a_request_are_bounded(pairs: Callable[..., Pair]) -> None:
    pair = pairs(offer_wait_s=0.2)
    offer = pair.reserve(30)
    assert offer is not None
    assert pair.sender.take_offer(30, offer.to_wire(), DECODE_ENDPOINT, DECODE_SESSION) is None
    wait_for(lambda: pair.sender.stats().dropped_offers == {"expired": 1}, "the offer to expire")
    assert pair.sender.stats().offers_waiting == 0
    pair.sender.open_room(30)
    assert pair.sender.size_room(30, N_TOKENS) is None  # nothing left to answer
    assert pair.sender.refusal(30) == (
        "decode's Lynx offer for room 30 was dropped: no request for room 30 came while its offer waited"
    )
    # decode hears why, and its space comes back: no write of prefill's can reach it
    assert pair.kinds(30) == [NoticeKind.REJECT]
    assert pair.receiver.residual_verdict(30) == (
        Verdict.FAIL,
        "prefill 10.0.0.1:8998 refused the Lynx transfer: no request for room 30 came while its offer waited",
    )
    pair.receiver.forget(30)
    assert pair.receiver.stats().quarantined == 0

    flood = pairs()
    for room in range(1000, 1000 + 4097):  # from five decode sessions, each within its quota
        flood.sender.take_offer(room, offer.to_wire(), DECODE_ENDPOINT, f"decode:{room % 5}")
    stats = flood.sender.stats()
    assert (stats.offers_waiting, stats.dropped_offers) == (4096, {"overflow": 1})
    flood.sender.open_room(1000)  # the oldest went
    assert flood.sender.size_room(1000, N_TOKENS) is None
    assert flood.sender.refusal(1000) == (
        "decode's Lynx offer for room 1000 was dropped: more than 4096 offers waited for rooms "
        "with no request; the oldest, for room 1000, is dropped"
    )
    flood.sender.open_room(1001)
    assert isinstance(flood.sender.size_room(1001, N_TOKENS), Offer)
    assert flood.kinds(1000) == [NoticeKind.REJECT]
    assert flood.notices[0].text == (
        "more than 4096 offers waited for rooms with no request; the oldest, for room 1000, is dropped"
    )


@pytest.mark.parametrize("prefill_tokens", [N_TOKENS - 1, N_TOKENS + 256])
def test_an_offer_for_another_token_count_is_refused_naming_both(
    pairs: Callable[..., Pair], prefill_tokens: int
) -> None:
    """Old: a smaller count silently truncated what was sent, a larger one was trusted."""
    pair = pairs()
    offer = pair.reserve(40)
    assert offer is not None
    reason = pair.answer(40, offer.to_wire(), n_tokens=prefill_tokens)
    assert reason == (
        f"decode 10.0.0.2:9000 offered space for {N_TOKENS} tokens, this prefill server's "
        f"request has {prefill_tokens}"
    )
    assert pair.kinds(40) == [NoticeKind.REJECT]
    assert (
        pair.wait_verdict(40, Verdict.FAIL) == f"prefill {PREFILL_ADDR} refused the Lynx transfer: {reason}"
    )
    assert pair.sender.refusal(40) == reason


def test_an_absurd_token_count_is_refused_before_anything_is_built(pairs: Callable[..., Pair]) -> None:
    """Old: 2**40 tokens made prefill build the request's layout for hours."""
    pair = pairs()
    offer = pair.reserve(41)
    assert offer is not None
    huge = Offer(offer.handshake, offer.nonce, offer.anchor_addr, 1 << 60, 0, 0, 1 << 40)
    started = time.monotonic()
    reason = pair.answer(41, huge.to_wire())
    assert time.monotonic() - started < 1.0
    assert reason == (
        f"decode 10.0.0.2:9000 offered space for {1 << 40} tokens, "
        f"this prefill server's request has {N_TOKENS}"
    )


def test_corrupt_landed_bytes_fail_before_any_kv_row_is_written(pairs: Callable[..., Pair]) -> None:
    """A changed byte, or garbage INT8 Residual codes, in what landed: the checksum of that
    segment differs and write_kv writes nothing. Old: decoded into the KV."""
    pair = pairs(checksums=True)
    offer = pair.offer(50)
    pair.send(50, offer, pair.pages(seed=36), [N_TOKENS])
    pair.wait_verdict(50, Verdict.READY)
    plan = RequestLayout.of(pair.handshake, N_TOKENS)
    base = offer.anchor_addr - pair.receive_buffer.data_ptr()
    space = pair.receive_buffer[base : base + plan.receive_nbytes]
    seg = plan.segments[1]  # tokens [256, 512)
    residual = plan.byte_ranges(seg)[1]
    pristine = space.clone()
    dst = torch.arange(N_TOKENS)
    gen = torch.Generator().manual_seed(0)
    for corrupt in (
        lambda: space[residual.start + 100].bitwise_xor_(1),
        lambda: space[residual].copy_(
            torch.randint(0, 256, (residual.stop - residual.start,), generator=gen)
        ),
    ):
        space.copy_(pristine)
        corrupt()
        # a changed byte fails its checksum; random bytes fail the lossless Residual's
        # head first (the range a checksum covers ends where that head says)
        with pytest.raises(
            ReceiveIntegrityError,
            match=r"Residual (bytes of tokens \[256, 512\) do not match|of tokens \[256, 512\): corrupt)",
        ):
            pair.receiver.write_kv(50, dst)
        assert all(not k.any() for k in pair.decode_k)  # not one row written
    space.copy_(pristine)
    anchor = plan.byte_ranges(plan.segments[2])[0]
    space[anchor.stop - 1] ^= 0x80
    with pytest.raises(ReceiveIntegrityError, match=r"room 50: the Anchor bytes of tokens \[512, 600\)"):
        pair.receiver.write_kv(50, dst)
    space.copy_(pristine)
    assert pair.receiver.write_kv(50, dst) is True


def test_a_corrupt_residual_fails_the_refinement_of_a_speculating_request(pairs: Callable[..., Pair]) -> None:
    pair = pairs(checksums=True, mode="speculative", residual_hold_s=0.5)
    offer = pair.offer(51)
    pair.send(51, offer, pair.pages(seed=37), [N_TOKENS])
    pair.wait_verdict(51, Verdict.READY)
    dst = torch.arange(N_TOKENS)
    assert pair.receiver.write_kv(51, dst) is False  # decoding on the Anchor
    wait_for(lambda: pair.receiver.residual_verdict(51)[0] is Verdict.READY, "the Residual")
    pair.receive_buffer[offer.residual_addr - pair.receive_buffer.data_ptr()] ^= 1
    with pytest.raises(ReceiveIntegrityError, match=r"Residual (bytes )?of tokens \[0, 256\)"):
        pair.receiver.write_kv(51, dst)


def play_prefill(
    pair: Pair, room: int, offer: Offer, space: torch.Tensor, extra_residual_nbytes: int = 0
) -> None:
    """A prefill that writes ``space`` (the request's Anchor and Residual regions) into the
    offered receive space itself and reports it with correct checksums (and the Residual
    stream ``extra_residual_nbytes`` longer than it is)."""
    plan = RequestLayout.of(pair.handshake, offer.n_tokens)
    base = offer.anchor_addr - pair.receive_buffer.data_ptr()
    pair.receive_buffer[base : base + plan.receive_nbytes] = space[: plan.receive_nbytes]
    pair.receiver.on_notice(forged(NoticeKind.ACCEPT, room, offer.nonce, handshake=pair.handshake.to_wire()))
    counts = plan.residual_nbytes_in(space)
    for stream in plan.streams:
        ranges = plan.stream_ranges(stream, counts)
        checksums = checksum_values([span_checksum(space[span]) for _, span in ranges])
        checksums = checksums if pair.handshake.checksums else []
        nbytes = sum(span.stop - span.start for _, span in ranges)
        nbytes += extra_residual_nbytes if stream is Stream.RESIDUAL else 0
        notice = forged(
            NoticeKind.LANDED, room, offer.nonce, stream=stream, nbytes=nbytes, checksums=tuple(checksums)
        )
        pair.receiver.on_notice(notice)


def encoded_space(pair: Pair, slots: torch.Tensor, codec: CodecConfig) -> tuple[RequestLayout, torch.Tensor]:
    """The request's Anchor and Residual regions as prefill encodes them."""
    plan = RequestLayout.of(pair.handshake, slots.numel())
    space = torch.zeros(plan.encoded_nbytes, dtype=torch.uint8)
    for seg in plan.segments:
        anchor, residual = plan.byte_ranges(seg)
        encode_pages(
            pair.prefill_k, pair.prefill_v, slots[seg.start : seg.end], codec, space[anchor], space[residual]
        )
    return plan, space


def raw_lossless_residual(pair: Pair, slots: torch.Tensor, capacity: int) -> torch.Tensor:
    """A segment's lossless Residual with every part stored raw (format byte 0, then its
    words), as a prefill may send it; ``slots`` are the segment's."""
    bodies = []
    for layer in range(LAYERS):
        for buffers in (pair.prefill_k, pair.prefill_v):
            words = buffers[layer][slots].reshape(-1).view(torch.uint8)
            bodies.append(torch.cat([torch.zeros(1, dtype=torch.uint8), words]))
    head = 4 * (1 + len(bodies))
    ends = (head + torch.tensor([b.numel() for b in bodies]).cumsum(0)).tolist()
    used = -(-ends[-1] // 16) * 16
    out = torch.zeros(capacity, dtype=torch.uint8)
    out[:head] = torch.tensor([used, *ends], dtype=torch.int32).view(torch.uint8)
    out[head : ends[-1]] = torch.cat(bodies)
    return out


@pytest.mark.parametrize(
    ("protect", "token", "value"),
    [
        ((0, 0), 300, float("nan")),
        ((16, 0), 3, float("nan")),
        ((0, 0), 599, float("inf")),
        ((0, 0), 0, -float("inf")),
    ],
)
def test_a_non_finite_word_in_a_lossless_residual_fails_the_request(
    pairs: Callable[..., Pair], protect: tuple[int, int], token: int, value: float
) -> None:
    """Checksums prove the bytes are prefill's, not that they are sane: a lossless Residual
    that decodes to a NaN word (here stored raw; at a protected token, decoded with the
    Anchor, or not) fails the request before any row of its segment is written."""
    codec = CodecConfig(residual="exact")
    pair = pairs(checksums=True, codec=codec, protect=protect)
    offer = pair.reserve(60)
    assert offer is not None
    slots = torch.as_tensor(pair.pages(seed=38))
    plan, space = encoded_space(pair, slots, codec)
    seg = next(s for s in plan.segments if s.start <= token < s.end)
    residual = plan.byte_ranges(seg)[1]
    space[residual] = raw_lossless_residual(pair, slots[seg.start : seg.end], seg.residual_nbytes)
    body = residual.start + 4 * (1 + 2 * LAYERS) + 1  # layer 0 keys, after the format byte
    at = body + 2 * ((token - seg.start) * HEADS * HEAD_DIM + 5)
    space[at : at + 2] = torch.tensor([value], dtype=torch.bfloat16).view(torch.uint8)
    play_prefill(pair, 60, offer, space)
    assert pair.verdict(60) == (Verdict.READY, None)
    with pytest.raises(
        ReceiveIntegrityError, match=rf"tokens \[{seg.start}, {seg.end}\).*NaN or infinite word"
    ):
        pair.receiver.write_kv(60, torch.arange(N_TOKENS))
    assert all(not k[seg.start : seg.end].any() for k in pair.decode_k)


def lossless_request(
    pairs: Callable[..., Pair], room: int, seed: int
) -> tuple[Pair, Offer, torch.Tensor, RequestLayout, torch.Tensor]:
    """A pair with the lossless Residual, an offer for ``room``, prefill's slots of the
    request and its encoded space."""
    pair = pairs(codec=CodecConfig(residual="exact"))
    offer = pair.reserve(room)
    assert offer is not None
    slots = torch.as_tensor(pair.pages(seed=seed))
    plan, space = encoded_space(pair, slots, pair.handshake.codec)
    return pair, offer, slots, plan, space


def test_a_raw_lossless_residual_decodes_like_a_coded_one(pairs: Callable[..., Pair]) -> None:
    """A decoder takes any part body the format allows: raw bodies give the same rows."""
    pair, offer, slots, plan, space = lossless_request(pairs, 61, seed=39)
    seg = plan.segments[1]
    space[plan.byte_ranges(seg)[1]] = raw_lossless_residual(
        pair, slots[seg.start : seg.end], seg.residual_nbytes
    )
    play_prefill(pair, 61, offer, space)
    assert pair.verdict(61) == (Verdict.READY, None)
    assert pair.receiver.write_kv(61, torch.arange(N_TOKENS))
    expect_k, expect_v = pair.prefill_rows(slots)
    for got, want in zip([*pair.decode_k, *pair.decode_v], [*expect_k, *expect_v], strict=True):
        assert torch.equal(got[:N_TOKENS].view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("corrupt", ["length", "part end", "format", "landed"])
def test_a_corrupt_lossless_residual_fails_the_request(pairs: Callable[..., Pair], corrupt: str) -> None:
    """Without checksums, a lossless Residual whose head, part bodies or landed count do not
    hold together fails its request with a clear error."""
    pair, offer, _, plan, space = lossless_request(pairs, 62, seed=40)
    play_prefill(pair, 62, offer, space, extra_residual_nbytes=16 if corrupt == "landed" else 0)
    assert pair.verdict(62) == (Verdict.READY, None)
    seg = plan.segments[1]
    base = offer.anchor_addr - pair.receive_buffer.data_ptr()
    residual = pair.receive_buffer[base : base + plan.receive_nbytes][plan.byte_ranges(seg)[1]]
    head = residual[: 4 * (1 + 2 * LAYERS)].view(torch.int32)
    expected = {
        "length": r"its head says \d+ bytes, a segment of 256 tokens has room for",
        "part end": r"part 3 of the segment ends at byte",
        "format": r"unknown part format",
        "landed": r"segments say they take \d+ bytes, prefill reported \d+ landed",
    }[corrupt]
    if corrupt == "length":
        head[0] = seg.residual_nbytes + 16
    elif corrupt == "part end":
        head[4] = head[3]  # part 3 ends where it starts: an empty body
    elif corrupt == "format":
        residual[int(head[1])] = 7  # the first byte of part 1's body
    with pytest.raises(ReceiveIntegrityError, match=expected):
        pair.receiver.write_kv(62, torch.arange(N_TOKENS))


# ---- bounded work before authentication; space reused only when quiet ------------------------


def test_a_forged_huge_notice_is_dropped_unread(pairs: Callable[..., Pair]) -> None:
    """An 8 MiB LANDED claiming 2M checksums, for no live reservation, is dropped and
    counted before any of it is read. Old: parsed in full first (~80 MB, seconds, on the
    thread that also carries upstream's status messages)."""
    pair = pairs(checksums=True)
    offer = pair.offer(60)
    payload = struct.pack("<QQBBQI", 60, offer.nonce ^ 1, 0, 1, 0, 2 << 20) + bytes(8 << 20)
    tracemalloc.start()
    try:
        pair.receiver.on_notice([TAG, NoticeKind.LANDED.value, payload])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    assert pair.receiver.stats().dropped_notices == {"oversized": 1}
    assert pair.receiver.verdict(60, AuxStatus.PENDING) == (Verdict.WAIT, None)


def test_a_landed_notice_is_read_only_as_far_as_its_plan_allows(pairs: Callable[..., Pair]) -> None:
    """With the live nonce, a LANDED claiming more checksums than the request has segments
    fails the request at once, its array unread. Old: dropped as malformed after trying to
    read it; the request waited for its deadline."""
    pair = pairs(checksums=True)
    offer = pair.offer(61)
    segments = len(RequestLayout.of(pair.handshake, N_TOKENS).segments)
    payload = struct.pack("<QQBBQI", 61, offer.nonce, 0, 1, 0, segments + 1) + bytes(4 * segments)
    pair.receiver.on_notice([TAG, NoticeKind.LANDED.value, payload])
    verdict, reason = pair.receiver.verdict(61, AuxStatus.PENDING)
    assert verdict is Verdict.FAIL
    assert reason == (
        f"prefill {PREFILL_ADDR} sent a Lynx notice this server cannot read: a LANDED notice "
        f"with {segments + 1} checksums, this request has {segments} segments"
    )


def test_quarantined_space_returns_on_released_refusal_or_peer_death_never_on_a_timer(
    pairs: Callable[..., Pair], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Old: quarantined space went back to the pool after 2x the deadline, whatever prefill's
    engine still held for it."""
    pair = pairs()
    unanswered, released, refused, orphan = (pair.reserve(room) for room in (70, 71, 72, 73))
    assert unanswered and released and refused and orphan
    pair.receiver.on_notice(forged(NoticeKind.REJECT, 72, refused.nonce, text="no"))  # writes nothing
    for room in (70, 71, 72):
        pair.receiver.forget(room)
    week = time.monotonic() + 7 * 24 * 3600.0
    with monkeypatch.context() as later:
        later.setattr(time, "monotonic", lambda: week)
        stats = pair.receiver.stats()
    size = request_nbytes(pair.handshake)
    assert (stats.quarantined, stats.buffer_used) == (2, 3 * size)
    pair.receiver.on_notice(forged(NoticeKind.RELEASED, 71, released.nonce))
    assert pair.receiver.stats().quarantined == 1
    pair.receiver.peer_lost(PREFILL_ADDR)  # upstream's heartbeat declared prefill dead
    pair.receiver.forget(73)
    stats = pair.receiver.stats()
    assert (stats.quarantined, stats.buffer_used) == (0, 0)


def test_anchor_bytes_changed_after_the_first_decode_fail_the_refinement(pairs: Callable[..., Pair]) -> None:
    """Speculative mode re-reads the Anchor when the Residual lands: a write that changed it
    in between must not reach the KV. Old: the refine trusted the first check."""
    pair = pairs(checksums=True, mode="speculative", residual_hold_s=0.5)
    offer = pair.offer(53)
    pair.send(53, offer, pair.pages(seed=38), [N_TOKENS])
    pair.wait_verdict(53, Verdict.READY)
    dst = torch.arange(N_TOKENS)
    assert pair.receiver.write_kv(53, dst) is False
    pair.receive_buffer[offer.anchor_addr - pair.receive_buffer.data_ptr() + 7] ^= 1
    wait_for(lambda: pair.receiver.residual_verdict(53)[0] is Verdict.READY, "the Residual")
    with pytest.raises(ReceiveIntegrityError, match=r"the Anchor bytes of tokens \[0, 256\) do not match"):
        pair.receiver.write_kv(53, dst)


def test_a_corrupt_scale_writes_no_row_without_checksums(pairs: Callable[..., Pair]) -> None:
    """Checksums off: a non-finite scale in the last segment. Old: the first two segments
    were written into the request's KV rows before it raised."""
    pair = pairs()
    offer = pair.offer(54)
    pair.send(54, offer, pair.pages(seed=39), [N_TOKENS])
    pair.wait_verdict(54, Verdict.READY)
    plan = RequestLayout.of(pair.handshake, N_TOKENS)
    anchor = plan.byte_ranges(plan.segments[2])[0]
    base = offer.anchor_addr - pair.receive_buffer.data_ptr()
    pair.receive_buffer[base + anchor.start : base + anchor.stop] = 0xFF  # NaN parameters
    with pytest.raises(ReceiveIntegrityError, match=r"tokens \[512, 600\): corrupt anchor"):
        pair.receiver.write_kv(54, torch.arange(N_TOKENS))
    assert all(not k.any() for k in pair.decode_k)
    assert all(not v.any() for v in pair.decode_v)


def test_a_prefill_that_finishes_without_answering_the_offer_leaves_no_space_quarantined(
    pairs: Callable[..., Pair],
) -> None:
    """A prefill without --lynx ignores the offer and reports upstream's Success: the request
    fails naming it, and its space is free at once (prefill's answer would have come before
    the Success, on the same socket; without one, nothing can write there). Old, with no
    timer: quarantined until that prefill died."""
    pair = pairs()
    assert pair.reserve(40) is not None
    verdict, reason = pair.receiver.verdict(40, AuxStatus.SUCCESS)
    assert verdict is Verdict.FAIL and "without answering Lynx's handshake" in (reason or "")
    pair.receiver.forget(40)
    stats = pair.receiver.stats()
    assert (stats.quarantined, stats.buffer_used) == (0, 0)


# ---- the Anchor layer by layer, during prefill's forward ------------------------------------------


def _stream_chunk(pair: Pair, room: int, offer: Offer, pages: np.ndarray, last: bool) -> list[int]:
    """Prefill computes one chunk: begin_chunk, every layer done in turn, then add_chunk;
    the Anchor bytes handed to the lanes after each layer."""
    assert pair.sender.begin_chunk(room, pages)
    sent = []
    for layer in range(LAYERS):
        pair.sender.layer_done(layer)
        sent.append(pair.sender.stats().anchor_bytes)
    pair.chunk(room, offer, pages, last)
    return sent


@pytest.mark.parametrize("residual", ["exact", "int8"])
def test_anchors_leave_layer_by_layer_and_the_request_decodes_as_sent_whole(
    pairs: Callable[..., Pair], residual: str
) -> None:
    """Each chunk's Anchor leaves one layer at a time while prefill computes it (the
    segments it completes, both chunks of a request); decode receives the same bytes and
    checksums as from a request sent whole, and decodes the same rows."""
    codec = CodecConfig(residual=residual)
    rows = {}
    for room, streamed in ((40, True), (41, False)):
        pair = pairs(codec=codec, checksums=True, layerwise_from=N_TOKENS)
        offer = pair.offer(room)
        pages = pair.pages(seed=40)
        if streamed:
            plan = RequestLayout(LAYOUT, codec, N_TOKENS, Mode.FULL)
            first = _stream_chunk(pair, room, offer, pages[:300], last=False)  # completes segment 1
            per_layer = plan.segments[0].anchor_nbytes // LAYERS
            assert first == [per_layer * (layer + 1) for layer in range(LAYERS)]
            _stream_chunk(pair, room, offer, pages[300:], last=True)  # segments 2 and 3
            stats = pair.sender.stats()
            assert stats.layers_streamed == 2 * LAYERS and stats.layer_encode_s > 0
        else:
            pair.send(room, offer, pages, [300, 300])
        pair.wait_verdict(room, Verdict.READY)
        dst = torch.arange(1000, 1000 + N_TOKENS)
        pair.receiver.write_kv(room, dst)
        rows[streamed] = pair.decode_rows(dst)
        landed = [n for n in pair.notices if n.kind is NoticeKind.LANDED]
        rows[streamed, "landed"] = sorted((n.stream, n.nbytes, n.checksums) for n in landed)
    assert rows[True, "landed"] == rows[False, "landed"]
    assert_rows_equal(rows[True], rows[False])


def test_layers_leave_together_once_they_are_enough_bytes_and_the_last_at_once(
    pairs: Callable[..., Pair],
) -> None:
    """Encoded layers wait until they are ``layer_send_bytes`` (a send costs CPU the forward
    shares); the last layer leaves at once; decode gets what a chunk-wise request gets."""
    plan = RequestLayout(LAYOUT, CodecConfig(), N_TOKENS, Mode.FULL)
    per_layer = plan.segments[0].anchor_nbytes // LAYERS
    pair = pairs(layerwise_from=1, layer_send_bytes=per_layer + 1)  # two layers a send
    offer = pair.offer(46)
    pages = pair.pages(seed=46)
    sent = _stream_chunk(pair, 46, offer, pages[:300], last=False)
    assert sent == [0, 2 * per_layer, 2 * per_layer, 4 * per_layer]  # LAYERS = 4
    _stream_chunk(pair, 46, offer, pages[300:], last=True)
    pair.wait_verdict(46, Verdict.READY)
    dst = torch.arange(1000, 1000 + N_TOKENS)
    pair.receiver.write_kv(46, dst)
    assert_rows_equal(pair.decode_rows(dst), pair.prefill_rows(page_slots(pages, 1)[:N_TOKENS]))


def test_by_default_layers_wait_for_company_only_while_the_high_lane_is_idle(
    pairs: Callable[..., Pair], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a fixed size, the first layer leaves at once (nothing is on the link yet);
    later ones wait until they are ``LAYER_SEND_BYTES`` while none of the request's HIGH
    writes is in flight (a fast link: spare the forward's CPU), and leave one by one while
    some is (a slow link: keep it busy)."""
    plan = RequestLayout(LAYOUT, CodecConfig(), N_TOKENS, Mode.FULL)
    per_layer = plan.segments[0].anchor_nbytes // LAYERS
    pair = pairs(layerwise_from=1, layer_send_bytes=None)
    monkeypatch.setattr(layer_streams, "LAYER_SEND_BYTES", 2 * per_layer)
    in_flight = {"now": False}
    monkeypatch.setattr(pair.sender._layers, "_high_in_flight", lambda room: in_flight["now"])
    offer = pair.offer(48)
    pages = pair.pages(seed=48)
    assert pair.sender.begin_chunk(48, pages[:300])
    sent = []
    for layer in range(LAYERS):
        in_flight["now"] = layer >= 3  # the second send is still on the link from layer 3 on
        pair.sender.layer_done(layer)
        sent.append(pair.sender.stats().anchor_bytes)
    assert sent == [per_layer, per_layer, 3 * per_layer, 4 * per_layer]
    pair.chunk(48, offer, pages[:300], False)
    pair.chunk(48, offer, pages[300:], True)
    pair.wait_verdict(48, Verdict.READY)
    dst = torch.arange(1000, 1000 + N_TOKENS)
    pair.receiver.write_kv(48, dst)
    assert_rows_equal(pair.decode_rows(dst), pair.prefill_rows(page_slots(pages, 1)[:N_TOKENS]))


def test_a_request_whose_high_writes_are_held_or_on_the_link_has_them_in_flight(
    pairs: Callable[..., Pair],
) -> None:
    pair = pairs(layerwise_from=1, layer_send_bytes=0, anchor_hold_s=30.0)
    pair.offer(49)
    pages = pair.pages(seed=49)
    assert pair.sender.begin_chunk(49, pages)
    assert not pair.sender._high_in_flight(49)
    pair.sender.layer_done(0)  # held 30 s before it goes to the lanes
    assert pair.sender._high_in_flight(49)
    assert not pair.sender._high_in_flight(50)  # another request's lane is idle
    pair.sender.abort(49)


def test_a_layer_encoded_but_not_yet_sent_is_sent_from_the_chunk_as_the_kv_is_then(
    pairs: Callable[..., Pair],
) -> None:
    """Only what left is held to the chunk's encode: a layer encoded during the forward
    and still waiting for company is encoded again with the chunk, from the KV as it is."""
    pair = pairs(layerwise_from=1, layer_send_bytes=1 << 30)
    offer = pair.offer(47)
    pages = pair.pages(seed=47)
    assert pair.sender.begin_chunk(47, pages)
    pair.sender.layer_done(0)
    assert pair.sender.stats().anchor_bytes == 0
    pair.prefill_k[0][int(pages[3])] += 1.0
    pair.chunk(47, offer, pages, True)
    assert pair.wait_verdict(47, Verdict.READY) is None
    dst = torch.arange(1000, 1000 + N_TOKENS)
    pair.receiver.write_kv(47, dst)
    assert_rows_equal(pair.decode_rows(dst), pair.prefill_rows(page_slots(pages, 1)[:N_TOKENS]))


def test_short_or_protected_requests_and_rooms_without_an_offer_do_not_stream(
    pairs: Callable[..., Pair],
) -> None:
    short = pairs(layerwise_from=N_TOKENS + 1)
    short.offer(45)
    assert not short.sender.begin_chunk(45, short.pages(seed=45))  # below --lynx-layerwise-from
    pair = pairs(protect=(0, N_TOKENS), layerwise_from=1)  # every token protected
    assert not pair.sender.begin_chunk(42, pair.pages(seed=1))  # no offer accepted
    offer = pair.offer(42)
    pages = pair.pages(seed=42)
    assert not pair.sender.begin_chunk(42, pages)
    pair.sender.layer_done(0)
    assert pair.backend.written() == []
    pair.chunk(42, offer, pages, True)
    assert pair.wait_verdict(42, Verdict.READY) is None
    assert pair.sender.stats().layers_streamed == 0


def test_a_layer_out_of_order_stops_the_stream_and_the_chunk_sends_the_rest(
    pairs: Callable[..., Pair],
) -> None:
    pair = pairs(codec=CodecConfig(residual="exact"), layerwise_from=1)
    offer = pair.offer(43)
    pages = pair.pages(seed=43)
    assert pair.sender.begin_chunk(43, pages)
    pair.sender.layer_done(0)
    pair.sender.layer_done(2)  # skipped layer 1: nothing more leaves early
    pair.sender.layer_done(1)
    assert pair.sender.stats().layers_streamed == 2
    pair.chunk(43, offer, pages, True)
    pair.wait_verdict(43, Verdict.READY)
    dst = torch.arange(1000, 1000 + N_TOKENS)
    pair.receiver.write_kv(43, dst)
    assert_rows_equal(pair.decode_rows(dst), pair.prefill_rows(page_slots(pages, 1)[:N_TOKENS]))


@pytest.mark.parametrize("fault", ["kv changed", "other slots"])
def test_a_streamed_anchor_that_is_not_the_chunks_fails_the_room(
    pairs: Callable[..., Pair], fault: str
) -> None:
    """What left layer by layer is checked against the chunk's own encode: KV rewritten
    after its layer was reported, or the chunk computed into other slots than announced,
    fails the request (its Anchor on decode is not the KV) instead of sending it."""
    pair = pairs(layerwise_from=1)
    offer = pair.offer(44)
    pages = pair.pages(seed=44)
    assert pair.sender.begin_chunk(44, pages)
    pair.sender.layer_done(0)
    if fault == "kv changed":
        pair.prefill_k[0][int(pages[3])] += 1.0
    else:
        pages = pages.copy()
        pages[[3, 4]] = pages[[4, 3]]
    pair.chunk(44, offer, pages, True)
    [(room, reason)] = pair.failures
    why = "differs from the chunk's" if fault == "kv changed" else "other KV slots than it announced"
    assert room == 44 and reason.startswith("room 44, tokens [0, 256): ") and why in reason
    assert pair.wait_verdict(44, Verdict.FAIL) is not None


def test_a_chunk_computed_before_the_previous_one_is_added_streams_too(pairs: Callable[..., Pair]) -> None:
    """Upstream's overlap scheduler runs a request's next chunk before it hands the sender
    the last one (announcing the pages from the first one not sent: both chunks'): both
    chunks' Anchors leave layer by layer, each held to its own chunk's encode, and decode
    gets what a chunk-wise request gets."""
    pair = pairs(layerwise_from=1)
    offer = pair.offer(62)
    pages = pair.pages(seed=62)
    for announced in (pages[:300], pages):
        assert pair.sender.begin_chunk(62, announced)
        for layer in range(LAYERS):
            pair.sender.layer_done(layer)
    plan = RequestLayout(LAYOUT, CodecConfig(), N_TOKENS, Mode.FULL)
    assert pair.sender.stats().anchor_bytes == plan.anchor_nbytes  # every segment streamed
    pair.chunk(62, offer, pages[:300], False)
    pair.chunk(62, offer, pages[300:], True)
    pair.wait_verdict(62, Verdict.READY)
    assert pair.sender.stats().layers_streamed == 2 * LAYERS and not pair.failures
    dst = torch.arange(1000, 1000 + N_TOKENS)
    pair.receiver.write_kv(62, dst)
    assert_rows_equal(pair.decode_rows(dst), pair.prefill_rows(page_slots(pages, 1)[:N_TOKENS]))


def test_a_next_chunk_whose_pages_disagree_with_the_streaming_one_goes_whole(
    pairs: Callable[..., Pair],
) -> None:
    pair = pairs(layerwise_from=1)
    offer = pair.offer(63)
    pages = pair.pages(seed=63)
    assert pair.sender.begin_chunk(63, pages[:300])
    for layer in range(LAYERS):
        pair.sender.layer_done(layer)
    assert not pair.sender.begin_chunk(63, pages[300:])  # not from the first page unsent
    pair.chunk(63, offer, pages[:300], False)
    pair.chunk(63, offer, pages[300:], True)
    pair.wait_verdict(63, Verdict.READY)
    assert pair.sender.stats().layers_streamed == LAYERS and not pair.failures
    dst = torch.arange(1000, 1000 + N_TOKENS)
    pair.receiver.write_kv(63, dst)
    assert_rows_equal(pair.decode_rows(dst), pair.prefill_rows(page_slots(pages, 1)[:N_TOKENS]))
