"""Prefill side: a request's chunks encoded into its send space, the Anchor first.

:meth:`ChunkEncoder.encode_pending` (scheduler thread, sender's lock held) encodes the
Anchors of a request's queued chunks and hands them to the HIGH lane at once, a protected
segment whole; each chunk's Residuals queue behind. :meth:`ChunkEncoder.encode_residuals`
(scheduler thread, lock not held while the codec runs) encodes them against the Anchors
that left and sends them layer by layer, one LOW part a layer: every segment's bytes of
its first layer, then of its next (:func:`lynx.codec.residual_layer_ends`); as the last
chunk's layers land, in order, decode hears ``LAYERS`` and may refine them while the rest
travels. Anchor layers that left during the forward (:mod:`lynx.transfer.layer_streams`)
are coded again here and must match, byte for byte.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable

import torch

from lynx.codec import CodecError, encode_pages, residual_layer_ends
from lynx.lanes import Lane
from lynx.transfer.protocol import Segment, Stream, checksum_values, span_checksum
from lynx.transfer.send_rooms import (
    Dispatch,
    Fail,
    LayerStream,
    ResidualWork,
    SendKV,
    SendRoom,
    SendRooms,
    Writes,
)

log = logging.getLogger(__name__)


class ChunkEncoder:
    """See the module docstring. ``pass_gated_of(room)`` (lock held) hands the room's
    streamed layers still waiting for their encode on a device to the lanes."""

    def __init__(
        self,
        rooms: SendRooms,
        kv: SendKV,
        *,
        dispatch: Dispatch,
        fail: Fail,
        pass_gated_of: Callable[[int], None],
    ) -> None:
        self._rooms = rooms
        self._lock = rooms.lock
        self._kv = kv
        self._dispatch = dispatch
        self._fail = fail
        self._pass_gated_of = pass_gated_of

    def encode_pending(self, state: SendRoom) -> None:
        """(Lock held) Encode the Anchors of the request's queued chunks and send them on the
        HIGH lane, its last chunk's with the stream's end; each chunk's Residuals queue
        behind (:meth:`encode_residuals`). A protected segment travels whole on the Anchor
        stream, so it is encoded here in full."""
        assert state.offset is not None
        plan = state.plan
        sends_residual = Stream.RESIDUAL in plan.streams
        submitted: list[tuple[Writes, bool]] = []
        checksums: list[torch.Tensor] = []
        while state.pending:
            slots, last = state.pending.popleft()
            state.slots.append(slots)
            state.tokens += slots.numel()
            ready = plan.ready(state.tokens, last=last)[state.segments_sent :]
            if last and state.tokens < plan.n_tokens:
                self._fail(state.room, f"prefill sent {state.tokens} tokens, decode expects {plan.n_tokens}")
                return
            if not ready and not last:
                continue
            all_slots = torch.cat(state.slots)[: plan.n_tokens].to(self._kv.buffer.device)
            space = state.space(self._kv.buffer)
            self._pass_gated_of(state.room)  # what left must be encoded before it is compared
            # the chunks that streamed, by their segments' starts
            streams = {seg.start: stream for stream in state.streams for seg in stream.segments}
            anchor_at = state.base_on(Stream.ANCHOR)
            writes: Writes = []
            sent: list[slice] = []  # each ready segment's bytes on the Anchor stream
            behind: list[Segment] = []  # those whose Residual follows on its own stream
            try:
                for seg in ready:
                    anchor, residual = plan.byte_ranges(seg)
                    stream_of = streams.get(seg.start)
                    layers_out = 0 if stream_of is None else stream_of.sent
                    # A streamed segment's Anchor is coded again aside, and must match what left.
                    anchor_out = torch.empty_like(space[anchor]) if layers_out else space[anchor]
                    residual_nbytes = encode_pages(
                        self._kv.k,
                        self._kv.v,
                        all_slots[seg.start : seg.end],
                        self._kv.handshake.codec,
                        anchor_out,
                        space[residual] if seg.protected else None,
                    )
                    out = plan.anchor_layers(seg, 0, layers_out)
                    if stream_of is not None:
                        stream_of.unchecked -= 1
                    if layers_out:
                        assert stream_of is not None
                        why = self._streamed_differs(seg, stream_of, all_slots, anchor_out, space, out)
                        if why is not None:
                            self._fail(
                                state.room, f"room {state.room}, tokens [{seg.start}, {seg.end}): {why}"
                            )
                            return
                        space[out.stop : anchor.stop] = anchor_out[out.stop - anchor.start :]
                    if sends_residual and not seg.protected:
                        behind.append(seg)
                    stream, span = plan.sent_ranges(seg, residual_nbytes if seg.protected else None)[0]
                    assert stream is Stream.ANCHOR
                    sent.append(span)
                    start = max(span.start, out.stop)  # what left layer by layer does not again
                    if start < span.stop:
                        writes.append((space.data_ptr() + start, anchor_at + start, span.stop - start))
            except CodecError as exc:
                self._fail(state.room, f"cannot encode the KV of room {state.room}: {exc}")
                return
            if self._kv.handshake.checksums:  # after the chunk's encode: interleaved with it, slower
                checksums.extend(span_checksum(space[span]) for span in sent)
            state.segments_sent += len(ready)
            state.streams = deque(stream for stream in state.streams if stream.unchecked)
            if writes or last:  # a chunk of streamed layers only has nothing left to send
                submitted.append((writes, last))
            if behind or (sends_residual and last):  # the stream ends even without bytes
                state.residuals.append(ResidualWork(behind, all_slots, last))
            if last:
                state.closed = True
        state.checksums[Stream.ANCHOR].extend(checksum_values(checksums))
        if not submitted:
            return
        if self._kv.buffer.is_cuda:
            # The lanes read the buffer from another thread: the encode must be done.
            torch.cuda.current_stream(self._kv.buffer.device).synchronize()
        now = time.monotonic()
        for writes, last in submitted:
            self._dispatch(state.room, Lane.HIGH, writes, last, now)

    def encode_residuals(self) -> None:
        """Encode and send every queued Residual, oldest room and chunk first, on the LOW
        lane (scheduler thread). The encode runs outside the lock (and the C++ codec outside
        the GIL), so the lanes' driver reports the streams that settle meanwhile, the
        Anchor's among them, and upstream's workers send the first token, without waiting
        for it; ``encoding`` keeps the room's space from being freed under it."""
        while True:
            with self._lock:
                state = next((s for s in self._rooms.rooms.values() if s.residuals and not s.failed), None)
                if state is None:
                    return
                work = state.residuals.popleft()
                state.encoding += 1
            try:
                self._encode_residual(state, work)
            except Exception as exc:  # this room fails; the scheduler thread serves on
                log.exception("Lynx: room %s: sending its Residual failed", state.room)
                self._fail(state.room, f"cannot send the KV of room {state.room}: {exc}")
            finally:
                with self._lock:
                    state.encoding -= 1

    def _encode_residual(self, state: SendRoom, work: ResidualWork) -> None:
        """(Lock not held) Encode the Residuals of ``work``'s segments against the Anchors
        that left for them, and send them layer by layer, one LOW part a layer (with the
        stream's end for the last chunk, whose layers are marked for ``LAYERS``)."""
        assert state.offset is not None
        plan = state.plan
        space = state.space(self._kv.buffer)
        residual_at = state.base_on(Stream.RESIDUAL)
        layers: list[Writes] = [[] for _ in range(plan.num_layers)]
        sent: list[slice] = []
        for seg in work.segments:
            anchor, residual = plan.byte_ranges(seg)
            anchor_again = torch.empty_like(space[anchor])
            try:
                residual_nbytes = encode_pages(
                    self._kv.k,
                    self._kv.v,
                    work.slots[seg.start : seg.end],
                    self._kv.handshake.codec,
                    anchor_again,
                    space[residual],
                )
                ends = residual_layer_ends(
                    space[residual], seg.end - seg.start, self._kv.handshake.layout, self._kv.handshake.codec
                )
            except CodecError as exc:
                self._fail(state.room, f"cannot encode the KV of room {state.room}: {exc}")
                return
            if not torch.equal(anchor_again, space[anchor]):  # a Residual codes against its Anchor
                tokens = f"tokens [{seg.start}, {seg.end})"
                self._fail(state.room, f"room {state.room}, {tokens}: the KV changed after its Anchor left")
                return
            stream, span = plan.sent_ranges(seg, residual_nbytes)[1]
            assert stream is Stream.RESIDUAL
            sent.append(span)
            for layer, (start, stop) in enumerate(itertools.pairwise([0, *ends])):
                at = span.start + start
                layers[layer].append((space.data_ptr() + at, residual_at + at, stop - start))
        if self._kv.buffer.is_cuda:
            torch.cuda.current_stream(self._kv.buffer.device).synchronize()
        checksums: list[int] = []
        by_layer: list[list[int]] = [[] for _ in layers]
        if self._kv.handshake.checksums:
            checksums = checksum_values([span_checksum(space[span]) for span in sent])
            parts = [(src - space.data_ptr(), n) for writes in layers for src, _, n in writes]
            values = iter(checksum_values([span_checksum(space[at : at + n]) for at, n in parts]))
            by_layer = [[next(values) for _ in writes] for writes in layers]
        with self._lock:
            if state.failed:
                return
            state.checksums[Stream.RESIDUAL].extend(checksums)
            if not state.layer_checksums:
                state.layer_checksums = [[] for _ in layers]
            for mine, more in zip(state.layer_checksums, by_layer, strict=True):
                mine.extend(more)
            now = time.monotonic()
            if not work.segments:  # the stream ends without bytes
                self._dispatch(state.room, Lane.LOW, [], work.last, now)
                return
            for layer, writes in enumerate(layers, start=1):
                last_layer = layer == plan.num_layers
                share = layer / plan.num_layers
                self._dispatch(state.room, Lane.LOW, writes, work.last and last_layer, now, share)
                state.residual_parts += 1
                if work.last and not last_layer:  # the last layer's landing is LANDED's
                    state.layer_marks.append((state.residual_parts, layer))

    @staticmethod
    def _streamed_differs(
        seg: Segment,
        stream: LayerStream,
        all_slots: torch.Tensor,
        anchor_out: torch.Tensor,
        space: torch.Tensor,
        out: slice,
    ) -> str | None:
        """Why the Anchor layers of ``seg`` that left during the forward (``out``, in the
        request's space) are not the chunk's own: other KV slots than announced, or KV
        that changed after its layer was written. None when they match, byte for byte."""
        tokens = slice(seg.start, seg.end)
        if not torch.equal(stream.slots[tokens], all_slots[tokens].to(stream.slots.device)):
            return "prefill computed them into other KV slots than it announced before its forward"
        start = out.start - seg.anchor_offset
        if not torch.equal(anchor_out[start : start + out.stop - out.start], space[out]):
            return "their Anchor sent layer by layer differs from the chunk's: the KV changed after"
        return None
