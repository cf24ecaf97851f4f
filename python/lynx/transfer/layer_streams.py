"""Prefill side: a chunk's Anchor, layer by layer, during prefill's forward.

Before its forward computes a chunk, the scheduler asks :meth:`LayerStreamer.begin_chunk`
whether the chunk's Anchor streams; during the forward :meth:`LayerStreamer.layer_done`
(the forward's per-layer hook, on the scheduler thread) encodes each layer's Anchor as
soon as prefill wrote its KV and sends the layers encoded so far once they are enough
bytes. :mod:`lynx.transfer.chunk_encoder`'s encode of the whole chunk later checks what
left against the chunk's own Anchor, byte for byte. On a CUDA send buffer the encode is
enqueued on the forward's stream and a gate thread hands its writes to the lanes once it
is done (the forward never waits). Everything here runs under the sender's lock.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from lynx.codec import CodecError, encode_pages, enqueue_anchor_pages
from lynx.lanes import Lane
from lynx.transfer.protocol import Stream
from lynx.transfer.send_rooms import Dispatch, Fail, LayerStream, SendKV, SendRoom, SendRooms, Writes

log = logging.getLogger(__name__)

LAYER_SEND_BYTES = 1 << 20
"""While nothing of a request is in flight on the HIGH lane, the Anchor layers its chunk
streams wait to leave together until they are this many bytes (the first and the last
layer leave at once); while some is, each layer leaves as it is encoded. Each send through
Mooncake's TCP transport takes CPU that prefill's forward shares: where a send lands
before the next layer is computed (a fast link), one a layer costs TTFT; where the link
is what TTFT waits for, sends are in flight and every layer leaves at once. The measured
trade-off is in docs/benchmarks.md."""


def page_slots(pages: np.ndarray | torch.Tensor, page_size: int) -> torch.Tensor:
    """Token slots (int64, CPU) of whole pages, in page order."""
    pages_t = torch.as_tensor(np.asarray(pages, dtype=np.int64))
    if page_size == 1:
        return pages_t
    return (pages_t[:, None] * page_size + torch.arange(page_size)).reshape(-1)


@dataclass
class _GatedWrite:
    """Anchor layers encoded on a CUDA stream: their HIGH writes leave once ``done`` (an
    event recorded after the encode) has happened."""

    done: torch.cuda.Event
    room: int
    writes: Writes


class LayerStreamer:
    """See the module docstring. ``room_of(room)``: the room's send state, made from its
    accepted offer (ValueError: none); ``start(state)``: give it send space and lanes
    (False: none free yet); ``high_in_flight(room)``: whether some of its HIGH writes have
    not landed. ``layerwise_from``: the fewest tokens a request has for its Anchor to
    stream (0: never); ``layer_send_bytes``: the fewest bytes of encoded layers that leave
    together (None: ``LAYER_SEND_BYTES`` while the request's HIGH lane is idle, else each
    layer; 0: each layer alone)."""

    def __init__(
        self,
        rooms: SendRooms,
        kv: SendKV,
        *,
        room_of: Callable[[int], SendRoom | None],
        start: Callable[[SendRoom], bool],
        dispatch: Dispatch,
        fail: Fail,
        high_in_flight: Callable[[int], bool],
        layerwise_from: int,
        layer_send_bytes: int | None,
    ) -> None:
        self._rooms = rooms
        self._lock = rooms.lock
        self._kv = kv
        self._room_of = room_of
        self._start = start
        self._dispatch = dispatch
        self._fail = fail
        self._high_in_flight = high_in_flight
        self._layerwise_from = layerwise_from
        self._layer_send_bytes = layer_send_bytes
        self.layers_streamed = 0  # layer Anchors sent during prefill's forward
        self.layer_encode_s = 0.0  # spent encoding them, on the forward's path
        # On a CUDA send buffer: streamed layers' writes waiting for their encode, in order,
        # and the thread that hands each to the lanes once it is done (started with the first).
        self._gated: deque[_GatedWrite] = deque()
        self._gate_wakes = threading.Condition(self._lock)
        self._gate: threading.Thread | None = None
        self._stopping = False

    def begin_chunk(self, room: int, pages: np.ndarray) -> bool:
        """Prefill is about to compute the request's next chunk into ``pages`` (before its
        forward; the sender's ``add_chunk`` follows with the same pages once the forward ends). The
        Anchors of the unprotected segments the chunk completes then leave layer by layer,
        each as soon as :meth:`layer_done` says prefill wrote that layer's KV, ahead of the
        rest of the chunk. Returns whether they will. They do not (add_chunk sends the
        chunk whole, as without this call) for a request of fewer than ``layerwise_from``
        tokens, for a room with no accepted offer, with earlier
        chunks waiting for send space or behind another room that waits, with no such
        segment in this chunk, or with pages outside the pool (add_chunk's encode names
        them). A chunk may begin before the previous one is added (upstream's overlap
        scheduler), once that one's forward is over."""
        with self._lock:
            try:
                state = self._room_of(room)
            except ValueError:
                return False
            if state is None or state.closed or state.pending:
                return False
            if state.streams and state.streams[-1].layers < self._kv.num_layers:
                return False  # the previous chunk's forward did not report every layer
            if not 0 < self._layerwise_from <= state.plan.n_tokens:
                return False
            if state.offset is None:
                if any(other.pending and other.offset is None for other in self._rooms.rooms.values()):
                    return False  # first come, first served
                try:
                    if not self._start(state):
                        return False
                except Exception:  # the lanes refused it: add_chunk's pump fails the room
                    log.exception("Lynx: room %s: cannot start its transfer", room)
                    return False
            plan = state.plan
            # ``pages`` run from the first token not added yet: under the overlap scheduler
            # they hold the previous chunk's too
            slots = torch.cat([*state.slots, page_slots(pages, self._kv.page_size)])[: plan.n_tokens]
            tokens = slots.numel()
            if tokens and not 0 <= int(slots.min()) <= int(slots.max()) < self._kv.k[0].shape[0]:
                return False  # on a device the encode would not check them
            done = state.segments_sent
            if state.streams:  # what the chunks computed before this one stream already
                earlier = state.streams[-1].slots
                if not torch.equal(slots[: earlier.numel()], earlier):
                    return False
                done = len(plan.ready(earlier.numel(), last=False))
            ready = plan.ready(tokens, last=tokens >= plan.n_tokens)[done:]
            segments = [seg for seg in ready if not seg.protected]
            if not segments:
                return False
            state.streams.append(LayerStream(segments, slots, slots.to(self._kv.buffer.device)))
            return True

    def layer_done(self, layer: int) -> None:
        """Prefill wrote layer ``layer``'s KV of the chunks it computes (during its forward):
        encode that layer's Anchor of each streaming chunk's segments, and send the layers
        encoded and not yet sent on the HIGH lane once they are enough bytes (the
        constructor's ``layer_send_bytes``) or the last layer (one write per segment).
        Layers come in order; a chunk whose next layer is another stops streaming there
        (add_chunk sends the layers left). On a CUDA send buffer the encode is enqueued on
        the current stream, after the layer's KV writes, and its writes leave once it is
        done (an event; the forward never waits): its values are checked by add_chunk's
        encode, before decode may use what left, and ``layer_encode_s`` counts only the
        enqueueing."""
        with self._lock:
            for state in list(self._rooms.rooms.values()):  # a failing room must not end the pass
                stream = state.streams[-1] if state.streams else None
                if stream is None or state.closed or stream.layers != layer:
                    continue
                started = time.perf_counter()
                plan = state.plan
                space = state.space(self._kv.buffer)
                try:
                    for seg in stream.segments:
                        pool = (self._kv.k[layer : layer + 1], self._kv.v[layer : layer + 1])
                        slots = stream.device_slots[seg.start : seg.end]
                        out = space[plan.anchor_layers(seg, layer, layer + 1)]
                        if self._kv.buffer.is_cuda:
                            enqueue_anchor_pages(*pool, slots, self._kv.handshake.codec, out)
                        else:
                            encode_pages(*pool, slots, self._kv.handshake.codec, out, None)
                except CodecError as exc:
                    self._fail(state.room, f"cannot encode the KV of room {state.room}: {exc}")
                    continue
                stream.layers += 1
                self.layers_streamed += 1
                self.layer_encode_s += time.perf_counter() - started
                spans = [plan.anchor_layers(seg, stream.sent, stream.layers) for seg in stream.segments]
                enough = self._layer_send_bytes
                if enough is None:
                    # The first layer has nothing on the link to wait behind: on a slow link
                    # its company would cost a layer's compute of link time.
                    alone = stream.sent == 0 or self._high_in_flight(state.room)
                    enough = 0 if alone else LAYER_SEND_BYTES
                if stream.layers < self._kv.num_layers and sum(s.stop - s.start for s in spans) < enough:
                    continue
                anchor_at = state.base_on(Stream.ANCHOR)
                writes = [(space.data_ptr() + s.start, anchor_at + s.start, s.stop - s.start) for s in spans]
                stream.sent = stream.layers
                if self._kv.buffer.is_cuda:
                    self._gate_until_encoded(state.room, writes)
                else:
                    self._dispatch(state.room, Lane.HIGH, writes, False, time.monotonic())

    def _gate_until_encoded(self, room: int, writes: Writes) -> None:
        """(Lock held) Hand ``writes`` to the lanes once the encode enqueued so far on the
        current CUDA stream is done."""
        done = torch.cuda.Event(blocking=True)  # its waiter sleeps rather than spins a core
        done.record(torch.cuda.current_stream(self._kv.buffer.device))
        self._gated.append(_GatedWrite(done, room, writes))
        if self._gate is None:
            self._gate = threading.Thread(target=self._pass_gated, name="lynx-sender-gate", daemon=True)
            self._gate.start()
        self._gate_wakes.notify()

    def _pass_gated(self) -> None:  # gate thread
        while True:
            with self._lock:
                self._gate_wakes.wait_for(lambda: self._gated or self._stopping)
                if self._stopping:
                    return
                head = self._gated[0]
            head.done.synchronize()
            with self._lock:
                if self._gated and self._gated[0] is head:  # else add_chunk passed it already
                    self._gated.popleft()
                    self._dispatch(head.room, Lane.HIGH, head.writes, False, time.monotonic())

    def pass_gated_of(self, room: int) -> None:
        """(Lock held) Wait for the encode of the request's gated writes (its forward is
        over) and hand them to the lanes, ahead of its chunk's own writes."""
        kept: deque[_GatedWrite] = deque()
        for gated in self._gated:
            if gated.room == room:
                gated.done.synchronize()
                self._dispatch(room, Lane.HIGH, gated.writes, False, time.monotonic())
            else:
                kept.append(gated)
        self._gated = kept

    def close(self) -> None:
        with self._lock:
            self._stopping = True
            self._gate_wakes.notify()
        if self._gate is not None:
            self._gate.join(timeout=5)
