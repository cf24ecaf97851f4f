"""The speculative decoder (``lynx.speculative``) over SGLang's engine operations
(``lynx_patches.decode_engine``) on stand-ins of SGLang's request, batch and scheduler,
with the forward passes, the answers and the step in flight the test's own
(:class:`StandInEngine`): admission, holding, parking, verification, commit and rollback.
The real objects are exercised end to end in ``test/e2e/test_lynx_speculative.py``; these
stand-ins carry only the fields ``lynx_patches.upstream`` reads and writes."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lynx.codec import CodecConfig, KVLayout
from lynx.mode import Mode
from lynx.speculative import META_INFO_KEY, SpeculativeDecoder
from lynx.transfer import Handshake, RequestLayout, RoomReport, Verdict
from lynx.verify import ParkReason, SpecState
from lynx_patches import output_streamer, runtime, upstream
from lynx_patches.decode_engine import SGLangDecodeEngine

VOCAB, PROMPT, ROOM = 16, 5, 11


class Receiver:
    handshake = Handshake(Mode.SPECULATIVE, CodecConfig(), KVLayout(2, 2, 64, torch.bfloat16))

    def __init__(self) -> None:
        self.verdicts: dict[int, tuple[Verdict, str | None]] = {}
        self.written: list[int] = []
        self.forgotten: list[int] = []
        self.layers: dict[int, int] = {}  # room -> layers refined

    def report(self, room: int) -> RoomReport:
        return RoomReport(100, 0, 0.1, None)

    def residual_verdict(self, room: int) -> tuple[Verdict, str | None]:
        return self.verdicts.get(room, (Verdict.WAIT, None))

    def write_kv(self, room: int, slots: torch.Tensor) -> bool:
        """As the receiver: the whole Residual is written once it landed (the tests send
        no LAYERS, so nothing is written before)."""
        landed = self.residual_verdict(room)[0] is Verdict.READY
        if landed:
            self.written.append(room)
        return landed

    def refined_layers(self, room: int) -> int:
        return self.layers.get(room, 0)

    def forget(self, room: int) -> RoomReport:
        self.forgotten.append(room)
        return RoomReport(100, 300, 0.1, 0.9)


class Req:
    def __init__(self, rid: str, room: int = ROOM, **sampling: Any) -> None:
        self.rid = rid
        self.bootstrap_room = room
        self.origin_input_ids = list(range(PROMPT))
        self.output_ids = [7]  # t_0, from prefill
        params = {"temperature": 1.0, "top_k": 1, "top_p": 1.0, "min_p": 0.0, "watermark": None, **sampling}
        self.sampling_params = SimpleNamespace(
            **params,
            frequency_penalty=0.0,
            presence_penalty=0.0,
            repetition_penalty=1.0,
            min_new_tokens=0,
            logit_bias=None,
        )
        self.return_logprob = False
        self.return_sampling_mask = False
        self.return_routed_experts = False
        self.return_indexer_topk = False
        # upstream's reasoning-token state machine (counted by the batch result processor)
        self.reasoning_tokens = 1  # t_0 was counted
        self._is_reasoning_over = False
        self._think_end_matcher = None
        self._think_end_match_len = 0
        self._think_start_match_len = 0
        self.grammar = None
        self.to_finish: str | None = None
        self.stream = True
        self.send_token_offset = 0  # tokens streamed so far
        self.finished_reason: str | None = None
        self.customized_info: dict | None = None
        self.kv = SimpleNamespace(req_pool_idx=3, kv_allocated_len=PROMPT, kv_committed_len=PROMPT)

    def finished(self) -> bool:
        return self.finished_reason is not None

    def update_finish_state(self, new_accepted_len: int = 1) -> None:
        if self.to_finish is not None:
            self.finished_reason = self.to_finish

    def decode_one(self, decoder: SpeculativeDecoder, token: int) -> None:
        """What a decode step and the update_finish_state hook do for a speculating request."""
        self.output_ids.append(token)
        self.kv.kv_allocated_len += 1
        ReasoningCounter._maybe_update_reasoning_tokens(self, token)
        decoder.hold(self, token)


class ReasoningCounter:
    """Upstream's counter, reduced: every token before the end-of-thinking token 0 counts."""

    @staticmethod
    def _maybe_update_reasoning_tokens(req: Req, next_token_id: int | list[int]) -> None:
        for token in next_token_id if isinstance(next_token_id, list) else [next_token_id]:
            if req._is_reasoning_over:
                return
            req.reasoning_tokens += 1
            req._is_reasoning_over = token == 0


class Batch:
    def __init__(self, reqs: list[Any]) -> None:
        self.reqs = reqs

    def filter_batch(self, keep_indices: list[int]) -> None:
        self.reqs = [self.reqs[i] for i in keep_indices]


class OutputStreamer:
    """Upstream's, reduced: each call streams every request's unsent tokens (a streamed
    request with none sends an empty chunk, as upstream's does at stream interval 1)."""

    def __init__(self) -> None:
        self.chunks: list[tuple[str, list[int]]] = []

    def stream_output(self, reqs: list[Any], return_logprob: bool) -> None:
        for req in reqs:
            if req.stream or req.finished():
                self.chunks.append((req.rid, req.output_ids[req.send_token_offset :]))
                req.send_token_offset = len(req.output_ids)


class Scheduler:
    def __init__(self, reqs: list[Any]) -> None:
        self.output_streamer = OutputStreamer()
        self.running_batch = Batch(reqs)
        self.waiting_queue: list[Any] = []
        self.freed: list[tuple[int, int]] = []
        self.tree_cache = SimpleNamespace(free_kv_row=lambda kv, ranges: self.freed.extend(ranges))
        self.batch_result_processor = ReasoningCounter()


class StandInEngine(SGLangDecodeEngine):
    """SGLang's engine operations over the stand-ins, but for what needs a model or a
    server: the verify forward (``verify_forward``), the answer to a finished request
    (recorded in ``answered``), an abort (set on the stand-in), and, where a test sets
    them, the overlap loop's step in flight (``in_flight``) and the layer-by-layer pass
    (``advance``, ``logits``, ``unsupported``)."""

    def __init__(self, verify_forward: Callable[..., list[torch.Tensor]], answered: list[Any]) -> None:
        self.verify_forward = verify_forward
        self.answered = answered
        self.in_flight: Callable[[Any], None] | None = None
        self.advance: Callable[..., None] | None = None
        self.logits: Callable[[Any, Any], torch.Tensor] | None = None
        self.unsupported: Callable[[Any], str | None] = lambda scheduler: None

    def run_verify_forward(
        self, scheduler: Any, reqs: Any, prompt_lens: Any, *, in_steps: bool, stop: Any
    ) -> Any:
        return self.verify_forward(scheduler, reqs, prompt_lens, in_steps=in_steps, stop=stop)

    def release_and_answer(self, scheduler: Any, req: Any) -> None:
        self.answered.append(req)

    def abort_with(self, req: Any, reason: str) -> None:
        req.to_finish = reason

    def process_in_flight_batch(self, scheduler: Any) -> None:
        assert self.in_flight is not None, "no step in flight outside the overlap loop"
        self.in_flight(scheduler)

    def layerwise_unsupported(self, scheduler: Any) -> str | None:
        return self.unsupported(scheduler)

    def advance_layerwise(self, scheduler: Any, req: Any, prompt_len: int, rows: Any, layers: int) -> None:
        assert self.advance is not None
        self.advance(scheduler, req, prompt_len, rows, layers)

    def layerwise_logits(self, scheduler: Any, rows: Any) -> torch.Tensor:
        assert self.logits is not None
        return self.logits(scheduler, rows)


@pytest.fixture
def world() -> SimpleNamespace:
    answered: list[Any] = []
    verify_logits: list[torch.Tensor] = []
    forwarded: list[list[str]] = []
    in_steps_asked: list[bool] = []
    rows_computed: list[list[int]] = []

    def verify_forward(
        scheduler: Any,
        reqs: list[Any],
        lens: list[int],
        *,
        in_steps: bool,
        stop: Callable[[int, int, torch.Tensor], bool] | None = None,
    ) -> list[torch.Tensor]:
        """Upstream's verify pass as the decoder sees it: the queued rows, in steps ended
        by ``stop`` as the real pass ends them."""
        forwarded.append([req.rid for req in reqs])
        in_steps_asked.append(in_steps)
        if verify_logits and isinstance(verify_logits[0], Exception):
            raise verify_logits[0]
        out = list(verify_logits)
        if in_steps and stop is not None:
            out = [
                rows[: next((i + 1 for i in range(len(rows)) if stop(n, i, rows[i])), len(rows))]
                for n, rows in enumerate(out)
            ]
        rows_computed.append([len(rows) for rows in out])
        return out

    engine = StandInEngine(verify_forward, answered)
    receiver = Receiver()
    decoder = SpeculativeDecoder(engine, receiver, max_tokens=3, page_size=1, metrics=None)  # type: ignore[arg-type]
    return SimpleNamespace(
        engine=engine,
        receiver=receiver,
        decoder=decoder,
        answered=answered,
        logits=verify_logits,
        forwarded=forwarded,
        in_steps_asked=in_steps_asked,
        rows_computed=rows_computed,
    )


def choosing(*tokens: int) -> torch.Tensor:
    rows = torch.zeros(len(tokens), VOCAB)
    rows[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return rows


def admitted(world: SimpleNamespace, req: Req) -> Scheduler:
    world.decoder.admit(req, ROOM, torch.arange(PROMPT), VOCAB)
    return Scheduler([req])


def test_held_tokens_park_at_the_cap_and_leave_the_batch(world: SimpleNamespace) -> None:
    req = Req("a")
    scheduler = admitted(world, req)
    assert world.decoder.speculations.is_speculating(req) and not world.decoder.speculations.holds_tokens(
        req
    )  # t_0 streams
    for token in (1, 2, 3):
        req.decode_one(world.decoder, token)
    assert not world.decoder.speculations.is_speculating(req) and world.decoder.speculations.holds_tokens(req)
    world.decoder.step(scheduler)  # the Residual is still in flight
    assert scheduler.running_batch.reqs == [] and list(world.decoder.speculations.parked_requests()) == [req]
    assert world.decoder.speculations.holds_kv_outside_batches()


def test_verification_commits_the_accepted_prefix_and_the_correction(world: SimpleNamespace) -> None:
    req = Req("a")
    scheduler = admitted(world, req)
    for token in (1, 2, 3):
        req.decode_one(world.decoder, token)
    world.receiver.verdicts[ROOM] = (Verdict.READY, None)
    world.logits.append(choosing(1, 0, 3))  # the second held token was wrong
    world.decoder.step(scheduler)
    assert req.output_ids == [7, 1, 0]
    assert (req.kv.kv_allocated_len, req.kv.kv_committed_len) == (PROMPT + 2, PROMPT + 2)
    assert scheduler.freed == [(PROMPT + 2, PROMPT + 3)]  # the KV of the rejected position
    assert scheduler.waiting_queue == [req] and world.receiver.written == [ROOM]
    assert world.receiver.forgotten == [ROOM]
    speculation = req.customized_info[META_INFO_KEY][0]["speculation"]  # type: ignore[index]
    assert (speculation["held"], speculation["accepted"], speculation["rejected"]) == (3, 1, True)
    assert speculation["park_reason"] == ParkReason.CAP.value and speculation["window"] == 3
    assert speculation["rejection_gap"] == pytest.approx(5.0)
    # the pass stopped at the rejected row: the third held token cost no decode step
    assert world.rows_computed == [[2]] and speculation["verified"] == 2
    stats = world.decoder.stats
    assert (stats.held_tokens, stats.accepted_tokens, stats.rejections, stats.active) == (3, 1, 1, 0)
    assert stats.agreement_rate == 0.5  # of the 2 rows computed, 1 agreed
    assert world.decoder.speculations.of(req) is None and not world.decoder.speculations.holds_tokens(req)


@pytest.mark.parametrize("in_steps", [True, False])
def test_the_verify_pass_runs_as_configured(world: SimpleNamespace, in_steps: bool) -> None:
    """In decode steps unless ``--lynx-verify-pass batched`` (one forward)."""
    if not in_steps:
        world.decoder = SpeculativeDecoder(
            world.engine,
            world.receiver,  # type: ignore[arg-type]
            max_tokens=3,
            page_size=1,
            metrics=None,
            verify_pass="batched",
        )
    req = Req("a")
    scheduler = admitted(world, req)
    req.decode_one(world.decoder, 1)
    world.receiver.verdicts[ROOM] = (Verdict.READY, None)
    world.logits.append(choosing(1))
    world.decoder.step(scheduler)
    assert world.in_steps_asked == [in_steps] and req.output_ids == [7, 1]


def test_a_residual_that_fails_rolls_back_to_the_first_token(world: SimpleNamespace) -> None:
    req = Req("a")
    scheduler = admitted(world, req)
    req.decode_one(world.decoder, 1)
    world.receiver.verdicts[ROOM] = (Verdict.FAIL, "the Residual did not land within 6s")
    world.decoder.step(scheduler)
    assert req.output_ids == [7]
    assert req.finished_reason == "Lynx: the Residual did not land within 6s"
    assert world.answered == [req] and scheduler.waiting_queue == []
    assert scheduler.freed == [(PROMPT, PROMPT + 1)]
    assert world.decoder.stats.failed == 1 and world.receiver.forgotten == [ROOM]


def test_logprobs_of_committed_tokens_come_from_the_verify_pass(world: SimpleNamespace) -> None:
    req = Req("a", temperature=1.0)
    req.return_logprob = True
    req.logprob = SimpleNamespace(
        top_logprobs_num=1,
        token_ids_logprob=[4],
        output_token_logprobs_val=[-0.5],  # t_0's, from prefill
        output_token_logprobs_idx=[7],
        output_top_logprobs_val=[[-0.5]],
        output_top_logprobs_idx=[[7]],
        output_token_ids_logprobs_val=[[]],  # prefill leaves t_0's token-id row empty
        output_token_ids_logprobs_idx=[[]],
    )
    scheduler = admitted(world, req)
    assert world.decoder.speculations.is_speculating(req)  # logprobs no longer wait for the Residual
    for token in (1, 2, 3):
        req.decode_one(world.decoder, token)
        for name in vars(req.logprob):
            if name.startswith("output_"):
                getattr(req.logprob, name).append("from the Anchor pass")
    world.receiver.verdicts[ROOM] = (Verdict.READY, None)
    logits = choosing(1, 0, 3)
    world.logits.append(logits)
    world.decoder.step(scheduler)
    assert req.output_ids == [7, 1, 0]
    full = torch.log_softmax(logits, dim=-1)
    lists = req.logprob
    assert lists.output_token_logprobs_idx == [7, 1, 0]
    assert lists.output_token_logprobs_val == pytest.approx([-0.5, float(full[0, 1]), float(full[1, 0])])
    assert lists.output_top_logprobs_idx == [[7], [1], [0]]
    assert lists.output_token_ids_logprobs_idx == [[], [4], [4]]
    assert lists.output_token_ids_logprobs_val[1:] == [[pytest.approx(float(full[i, 4]))] for i in range(2)]


def test_a_residual_expected_before_a_draft_would_pay_is_waited_for(
    world: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A window of 0 (the Residual is expected to land within a decode step): the request
    streams t_0 and leaves the batch before it decodes a draft, in the step that agrees on
    its window; it then decodes as a plain request once its Residual landed."""
    residual = RequestLayout.of(Receiver.handshake, PROMPT).sent_residual_nbytes
    world.decoder.window.observe_residual(residual, 0.05)
    world.decoder.window.observe_decoding(10, 1.0, PROMPT)  # 0.1 s a step
    req, other = Req("a"), Req("b", room=ROOM + 1)
    other.output_ids.append(3)
    scheduler = Scheduler([other])
    world.decoder.admit(req, ROOM, torch.arange(PROMPT), VOCAB)
    scheduler.waiting_queue.append(req)  # where upstream queues a transferred request
    world.decoder.step(scheduler)  # the Residual is still in flight
    spec = world.decoder.speculations.of(req)
    assert spec is not None and spec.held.state is SpecState.PARKED and spec.held.cap == 0
    assert spec.held.park_reason is ParkReason.CAP and spec.held.tokens == []
    assert scheduler.waiting_queue == [] and list(world.decoder.speculations.parked_requests()) == [req]
    assert (world.decoder.stats.requests, world.decoder.stats.waited) == (0, 1)
    # it never joins a batch, whose prebuilt step streams t_0: t_0 streams now
    assert scheduler.output_streamer.chunks == [("a", [7])]
    world.receiver.verdicts[ROOM] = (Verdict.READY, None)
    world.decoder.step(scheduler)
    assert req.output_ids == [7] and scheduler.waiting_queue == [req]
    speculation = req.customized_info[META_INFO_KEY][0]["speculation"]  # type: ignore[index]
    assert (speculation["held"], speculation["window"], speculation["park_reason"]) == (0, 0, "cap")
    # upstream's prebuilt step takes it into a batch: no chunk repeats t_0; the next token streams
    lynx = SimpleNamespace(decoder=world.decoder, streamed_ahead=world.decoder.streamed_ahead)
    monkeypatch.setattr(runtime, "current", lambda: lynx)
    streamer = scheduler.output_streamer

    def stream(reqs: list[Any]) -> None:
        output_streamer._hold_back(OutputStreamer.stream_output, streamer, reqs, False)

    stream([req, other])
    assert streamer.chunks == [("a", [7]), ("b", [7, 3])]
    req.output_ids.append(4)
    stream([req])
    assert streamer.chunks[-1] == ("a", [4])


@pytest.mark.parametrize(("flight_s", "cap"), [(0.15, 0), (0.35, 2), (10.0, 2)])
def test_under_overlap_the_late_token_counts_in_the_window(
    world: SimpleNamespace, flight_s: float, cap: int
) -> None:
    """A request parked at its cap in a batch holds the token of the step launched before
    (the late token), so its cap is one under the tokens the window allows: 1 becomes 0 (it
    waits), 3 becomes 2 (it holds 3), and --lynx-max-speculative-tokens 3 is 3 held."""
    decoder = SpeculativeDecoder(
        world.engine, world.receiver, max_tokens=3, page_size=1, metrics=None, overlap=True
    )  # type: ignore[arg-type]
    decoder.window.observe_residual(
        RequestLayout.of(Receiver.handshake, PROMPT).sent_residual_nbytes, flight_s
    )
    decoder.window.observe_decoding(10, 1.0, PROMPT)  # 0.1 s a step: steps allows flight_s / 0.1
    req = Req("a")
    decoder.admit(req, ROOM, torch.arange(PROMPT), VOCAB)
    assert decoder.speculations.get(req).held.cap == cap


def test_settings_it_cannot_verify_wait_for_the_residual(world: SimpleNamespace) -> None:
    req = Req("a")
    req.grammar = object()  # a grammar's state cannot be rewound
    scheduler = admitted(world, req)
    spec = world.decoder.speculations.of(req)
    assert spec is not None and spec.held.state is SpecState.PARKED
    assert spec.held.park_reason is ParkReason.UNVERIFIABLE and world.decoder.stats.waited == 1
    world.receiver.verdicts[ROOM] = (Verdict.READY, None)
    world.decoder.step(scheduler)
    assert req.output_ids == [7] and scheduler.waiting_queue == [req]  # refined, nothing to verify
    assert scheduler.output_streamer.chunks == [("a", [7])]  # t_0 streamed as it parked
    assert req.customized_info[META_INFO_KEY][0]["speculation"]["held"] == 0  # type: ignore[index]


def test_sampled_requests_keep_their_draft_distributions(world: SimpleNamespace) -> None:
    req = Req("s", top_k=VOCAB, temperature=0.5)
    admitted(world, req)
    spec = world.decoder.speculations.of(req)
    assert spec is not None and spec.sampled
    assert world.decoder.speculations.sampled_rows() == {3: spec}
    with pytest.raises(RuntimeError, match="draft distribution was not kept"):
        req.decode_one(world.decoder, 1)
    spec.pending_probs.append(torch.full((VOCAB,), 1.0 / VOCAB))
    req.decode_one(world.decoder, 2)
    assert spec.held.tokens == [2] and not spec.pending_probs


def test_per_token_outputs_wait_for_the_residual(world: SimpleNamespace) -> None:
    req = Req("a")
    req.return_sampling_mask = True  # a held token's mask would come from the Anchor pass
    admitted(world, req)
    spec = world.decoder.speculations.of(req)
    assert spec is not None and spec.held.park_reason is ParkReason.UNVERIFIABLE


def test_usage_counts_only_committed_reasoning_tokens(world: SimpleNamespace) -> None:
    req = Req("a")
    scheduler = admitted(world, req)
    for token in (1, 2, 0):  # the third held token would end the thinking
        req.decode_one(world.decoder, token)
    assert req.reasoning_tokens == 4 and req._is_reasoning_over
    world.receiver.verdicts[ROOM] = (Verdict.READY, None)
    world.logits.append(choosing(1, 3, 0))  # the second held token is rejected, 3 committed
    world.decoder.step(scheduler)
    assert req.output_ids == [7, 1, 3]
    assert req.reasoning_tokens == 3 and not req._is_reasoning_over  # t_0, 1 and 3


def _two_held(world: SimpleNamespace, rid: str, room: int, tokens: tuple[int, ...]) -> Req:
    req = Req(rid, room)
    world.decoder.admit(req, room, torch.arange(PROMPT), VOCAB)
    for token in tokens:
        req.decode_one(world.decoder, token)
    world.receiver.verdicts[room] = (Verdict.READY, None)
    return req


def test_two_live_requests_with_one_client_rid_keep_their_own_state(world: SimpleNamespace) -> None:
    """A request's speculation is found by its room and its own object, never by the rid a
    client chose: two live requests that share one do not see each other's held tokens."""
    first = _two_held(world, "same", ROOM, (1, 2))
    second = _two_held(world, "same", ROOM + 1, (3,))
    world.receiver.verdicts[ROOM + 1] = (Verdict.WAIT, None)
    assert world.decoder.speculations.of(first).held.tokens == [1, 2]  # type: ignore[union-attr]
    assert world.decoder.speculations.of(second).held.tokens == [3]  # type: ignore[union-attr]
    stranger = Req("same", ROOM)  # the first one's room, another object: none of its state
    assert world.decoder.speculations.of(stranger) is None and not world.decoder.speculations.takes_token(
        stranger
    )
    scheduler = Scheduler([first, second])
    world.logits.append(choosing(1, 2))
    world.decoder.step(scheduler)
    assert first.output_ids == [7, 1, 2] and world.decoder.speculations.of(first) is None
    assert world.forwarded == [["same"]] and scheduler.running_batch.reqs == [second]
    assert world.decoder.speculations.of(second).held.tokens == [3]  # type: ignore[union-attr]
    world.receiver.verdicts[ROOM + 1] = (Verdict.READY, None)
    world.logits[:] = [choosing(3)]
    world.decoder.step(scheduler)
    assert second.output_ids == [7, 3] and world.decoder.stats.active == 0


def test_a_bad_draft_fails_its_own_request_only(world: SimpleNamespace) -> None:
    good = _two_held(world, "good", ROOM, (1, 2))
    bad = _two_held(world, "bad", ROOM + 1, (1, VOCAB + 5))  # outside the vocabulary
    scheduler = Scheduler([good, bad])
    world.logits.append(choosing(1, 2))
    world.decoder.step(scheduler)
    assert world.forwarded == [["good"]]  # the bad request never reached the forward
    assert bad.output_ids == [7] and bad.finished_reason is not None
    assert "outside the vocabulary" in bad.finished_reason and world.answered == [bad]
    assert good.output_ids == [7, 1, 2] and scheduler.waiting_queue == [good]
    assert world.decoder.stats.failed == 1 and world.decoder.stats.active == 0


def test_a_failed_verify_forward_fails_its_requests_and_not_the_server(world: SimpleNamespace) -> None:
    req = _two_held(world, "a", ROOM, (1, 2))
    scheduler = Scheduler([req])
    world.logits.append(RuntimeError("device fault"))
    world.decoder.step(scheduler)
    assert req.output_ids == [7] and req.finished_reason == "Lynx: the verify forward failed: device fault"
    assert world.answered == [req] and world.decoder.stats.active == 0
    later = _two_held(world, "b", ROOM + 1, (1,))  # the decoder serves on
    world.logits[:] = [choosing(1)]
    world.decoder.step(Scheduler([later]))
    assert later.output_ids == [7, 1]


def test_draft_distributions_are_bounded_and_accounted(world: SimpleNamespace) -> None:
    row = VOCAB * 4
    world.decoder.draft_memory_bytes = 3 * row  # room for three held sampled tokens in all
    first, second = Req("s1", top_k=VOCAB), Req("s2", ROOM + 1, top_k=VOCAB)
    world.decoder.admit(first, ROOM, torch.arange(PROMPT), VOCAB)
    world.decoder.admit(second, ROOM + 1, torch.arange(PROMPT), VOCAB)
    specs = [world.decoder.speculations.of(r) for r in (first, second)]
    for req, spec in ((first, specs[0]), (first, specs[0]), (second, specs[1])):
        assert spec is not None
        spec.pending_probs.append(torch.full((VOCAB,), 1.0 / VOCAB))
        req.decode_one(world.decoder, 1)
    stats = world.decoder.stats
    assert stats.draft_bytes == stats.draft_bytes_peak == 3 * row
    assert specs[1] is not None and specs[1].held.park_reason is ParkReason.DRAFT_MEMORY
    third = Req("s3", ROOM + 2, top_k=VOCAB)
    world.decoder.admit(third, ROOM + 2, torch.arange(PROMPT), VOCAB)  # no room for its first draft
    spec3 = world.decoder.speculations.of(third)
    assert spec3 is not None and spec3.held.park_reason is ParkReason.DRAFT_MEMORY
    world.receiver.verdicts[ROOM] = (Verdict.READY, None)
    world.logits.append(torch.zeros(2, VOCAB))  # uniform: the rule may accept or reject
    world.decoder.step(Scheduler([first]))
    assert stats.draft_bytes == row  # the first request's drafts were released with it


def test_a_retracting_pause_rolls_speculation_back_first(world: SimpleNamespace) -> None:
    running, parked = Req("running"), Req("parked", ROOM + 1)
    world.decoder.admit(running, ROOM, torch.arange(PROMPT), VOCAB)
    world.decoder.admit(parked, ROOM + 1, torch.arange(PROMPT), VOCAB)
    running.decode_one(world.decoder, 1)
    for token in (1, 2, 3):
        parked.decode_one(world.decoder, token)
    scheduler = Scheduler([running, parked])
    world.decoder.step(scheduler)  # the capped one leaves the batch
    assert scheduler.running_batch.reqs == [running]
    world.decoder.roll_back_for_retraction(scheduler)
    assert running.output_ids == parked.output_ids == [7]  # held tokens were never verified
    assert running.kv.kv_allocated_len == parked.kv.kv_allocated_len == PROMPT
    assert scheduler.waiting_queue == [parked]  # upstream retracts it with the running ones
    assert world.receiver.forgotten == [ROOM, ROOM + 1] and world.decoder.stats.rolled_back == 2
    assert world.decoder.stats.active == 0 and not world.decoder.speculations.holds_kv_outside_batches()
    world.receiver.verdicts[ROOM] = (Verdict.READY, None)
    world.decoder.step(scheduler)  # a Residual landing later writes nothing
    assert world.receiver.written == [] and running.reasoning_tokens == 1


def test_tp_ranks_verify_only_once_every_rank_refined(world: SimpleNamespace) -> None:
    """This rank's Residual landed, the other rank's not yet: this rank refines its KV and
    keeps decoding; both verify in the iteration where the other rank's lands too."""
    other = {"verdict": 1}  # the other rank: WAIT, then READY

    def reduce_min(values: list[int]) -> list[int]:
        # [window, verdict code, room key, -room key] for one tracked request
        theirs = [1, other["verdict"], values[2], values[3]]  # its window estimate: 1
        return [min(a, b) for a, b in zip(values, theirs, strict=True)]

    req = Req("a")
    scheduler = admitted(world, req)
    world.receiver.verdicts[ROOM] = (Verdict.READY, None)
    world.decoder.step(scheduler, reduce_min)
    assert world.receiver.written == [ROOM] and world.decoder.speculations.is_speculating(req)
    assert scheduler.running_batch.reqs == [req] and world.forwarded == []
    req.decode_one(world.decoder, 1)  # the agreed window (the smaller estimate) is 1: it parks
    assert not world.decoder.speculations.is_speculating(req) and world.decoder.speculations.holds_tokens(req)
    other["verdict"] = 2
    world.logits.append(choosing(1))
    world.decoder.step(scheduler, reduce_min)
    assert world.receiver.written == [ROOM]  # refined once
    assert world.forwarded == [["a"]] and req.output_ids == [7, 1]
    assert scheduler.waiting_queue == [req]


def test_a_residual_failed_on_another_rank_fails_the_request_here(world: SimpleNamespace) -> None:
    def reduce_min(values: list[int]) -> list[int]:
        return [values[0], 0, values[2], values[3]]  # the other rank: FAIL

    req = Req("a")
    scheduler = admitted(world, req)
    req.decode_one(world.decoder, 1)
    world.receiver.verdicts[ROOM] = (Verdict.READY, None)
    world.decoder.step(scheduler, reduce_min)
    assert req.output_ids == [7] and world.answered == [req]
    assert req.finished_reason is not None and "another TP rank" in req.finished_reason
    assert world.forwarded == []


@pytest.fixture
def overlapped(world: SimpleNamespace) -> SimpleNamespace:
    """The decoder under upstream's overlap loop: ``world.in_flight`` lists the requests
    of the step in flight, whose tokens ``process_in_flight_batch`` delivers. Its cap is
    3, as the other tests' (4 tokens at most: 3 and the late one)."""
    world.decoder = SpeculativeDecoder(
        world.engine, world.receiver, max_tokens=4, page_size=1, metrics=None, overlap=True
    )  # type: ignore[arg-type]
    world.in_flight, world.drained = [], []

    def process_in_flight_batch(scheduler: Any) -> None:
        world.drained.append(len(world.in_flight))
        for req, token in world.in_flight:
            if world.decoder.speculations.takes_token(req):
                req.decode_one(world.decoder, token)
        world.in_flight.clear()

    world.engine.in_flight = process_in_flight_batch
    return world


def test_overlap_parked_request_holds_its_one_late_token(overlapped: SimpleNamespace) -> None:
    req = Req("a")
    scheduler = admitted(overlapped, req)
    for token in (1, 2, 3):
        req.decode_one(overlapped.decoder, token)
    assert not overlapped.decoder.speculations.is_speculating(req)  # parked at the cap...
    assert overlapped.decoder.speculations.takes_token(req)  # ...with the step launched before still to come
    req.decode_one(overlapped.decoder, 4)
    assert overlapped.decoder.speculations.of(req).held.tokens == [1, 2, 3, 4]  # type: ignore[union-attr]
    assert not overlapped.decoder.speculations.takes_token(req)
    overlapped.decoder.step(scheduler)  # Residual still in flight: nothing to drain
    assert overlapped.drained == [] and scheduler.running_batch.reqs == []


def test_overlap_verification_processes_the_step_in_flight_first(overlapped: SimpleNamespace) -> None:
    req = Req("a")
    scheduler = admitted(overlapped, req)
    req.decode_one(overlapped.decoder, 1)
    overlapped.in_flight.append((req, 2))  # launched before the Residual landed
    overlapped.receiver.verdicts[ROOM] = (Verdict.READY, None)
    overlapped.logits.append(choosing(1, 2))
    overlapped.decoder.step(scheduler)
    assert overlapped.drained == [1]  # one bubble, before the request left the batch
    assert overlapped.forwarded == [["a"]] and req.output_ids == [7, 1, 2]
    assert scheduler.waiting_queue == [req] and scheduler.running_batch.reqs == []


def test_a_watermarked_request_is_seen_as_one() -> None:
    # Found by test_boundary_contract.py: the watermark was read off the request, which has
    # none (upstream keeps it in the sampling parameters), so a watermarked request speculated.
    req = Req("w", watermark={"key": 1})
    assert upstream.sampling_settings(req, vocab=32).watermark
    req.sampling_params.watermark = None
    assert not upstream.sampling_settings(req, vocab=32).watermark


def test_the_verify_pass_in_steps_ends_each_requests_rows_at_its_stop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Upstream's verify pass in decode steps: a request whose row was judged a rejection
    leaves the next steps' batches; the others go on to their last held token."""
    from lynx_patches.upstream import verify_forward as module

    steps: list[list[tuple[str, int]]] = []

    def decode_forward(scheduler: Any, rows: list[tuple[Any, int, int]]) -> torch.Tensor:
        steps.append([(req.rid, i) for req, _, i in rows])
        return torch.stack([torch.full((VOCAB,), float(i)) for _, _, i in rows])

    monkeypatch.setattr(module, "_decode_forward", decode_forward)
    short, long = Req("short"), Req("long")
    for req, held in ((short, 3), (long, 4)):
        req.output_ids = [7, *range(held)]
        req.kv.kv_allocated_len = PROMPT + held
    logits = module.run_verify_forward(
        None, [short, long], [PROMPT, PROMPT], in_steps=True, stop=lambda n, i, row: n == 0 and i == 1
    )
    assert steps == [
        [("short", 0), ("long", 0)],
        [("short", 1), ("long", 1)],
        [("long", 2)],
        [("long", 3)],
    ]
    assert [tuple(rows.shape) for rows in logits] == [(2, VOCAB), (4, VOCAB)]
    steps.clear()
    module.run_verify_forward(None, [short, long], [PROMPT, PROMPT], in_steps=True)
    assert len(steps) == 4 and steps[2] == [("short", 2), ("long", 2)]  # no stop: every row


@pytest.fixture
def ahead(world: SimpleNamespace) -> SimpleNamespace:
    """The decoder with ``--lynx-verify-pass layers``, over upstream's layerwise pass as the
    decoder sees it: ``world.advanced`` records each advance (request, rows it had, layers
    asked), ``world.layerwise_logits`` is what the rows give once every layer is done."""
    world.decoder = SpeculativeDecoder(
        world.engine, world.receiver, max_tokens=3, page_size=1, metrics=None, verify_pass="layers"
    )  # type: ignore[arg-type]
    world.advanced, world.layerwise_logits, world.unsupported = [], [], [None]

    def advance(scheduler: Any, req: Any, prompt_len: int, rows: upstream.LayerwiseRows, layers: int) -> None:
        assert prompt_len == PROMPT
        world.advanced.append((req.rid, len(rows.batches), layers))
        if world.layerwise_logits and isinstance(world.layerwise_logits[0], Exception):
            raise world.layerwise_logits[0]
        rows.batches = list(range(len(req.output_ids) - 1))
        rows.layers = max(rows.layers, layers)

    def logits(scheduler: Any, rows: upstream.LayerwiseRows) -> torch.Tensor:
        assert rows.layers == LAYERS_OF_MODEL
        return world.layerwise_logits.pop(0)

    world.engine.advance = advance
    world.engine.logits = logits
    world.engine.unsupported = lambda scheduler: world.unsupported[0]
    return world


LAYERS_OF_MODEL = 2  # the Receiver's handshake


def parked(world: SimpleNamespace, *tokens: int) -> tuple[Req, Scheduler]:
    req = Req("a")
    scheduler = admitted(world, req)
    for token in tokens:
        req.decode_one(world.decoder, token)
    return req, scheduler


def test_a_parked_requests_rows_run_through_each_layer_as_it_is_refined(ahead: SimpleNamespace) -> None:
    req, scheduler = parked(ahead, 1, 2, 3)
    ahead.decoder.step(scheduler)  # parked; nothing refined yet: nothing to run
    assert ahead.advanced == [] and scheduler.running_batch.reqs == []
    ahead.receiver.layers[ROOM] = 1
    ahead.decoder.step(scheduler)
    ahead.decoder.step(scheduler)  # no new layer: no work
    assert ahead.advanced == [("a", 0, 1)]
    ahead.receiver.layers[ROOM] = LAYERS_OF_MODEL
    ahead.receiver.verdicts[ROOM] = (Verdict.READY, None)
    ahead.layerwise_logits.append(choosing(1, 0, 3))
    ahead.decoder.step(scheduler)
    assert ahead.advanced == [("a", 0, 1), ("a", 3, LAYERS_OF_MODEL)]  # the layer left, then logits
    assert ahead.forwarded == []  # no verify pass in steps
    assert req.output_ids == [7, 1, 0]
    speculation = req.customized_info[META_INFO_KEY][0]["speculation"]  # type: ignore[index]
    assert (speculation["accepted"], speculation["verified_ahead_layers"]) == (1, 1)
    assert speculation["verify_ahead_s"] >= 0.0 and ahead.decoder.stats.verify_ahead_seconds >= 0.0


def test_rows_do_not_run_ahead_while_the_request_decodes(ahead: SimpleNamespace) -> None:
    req, scheduler = parked(ahead, 1)  # one held token, below the cap: still decoding
    ahead.receiver.layers[ROOM] = 1
    ahead.decoder.step(scheduler)
    assert ahead.advanced == [] and scheduler.running_batch.reqs == [req]
    req.decode_one(ahead.decoder, 2)
    req.decode_one(ahead.decoder, 3)  # parked
    ahead.decoder.step(scheduler)
    assert ahead.advanced == [("a", 0, 1)]


def test_where_upstream_says_rows_cannot_run_ahead_they_verify_in_steps(
    ahead: SimpleNamespace, caplog: pytest.LogCaptureFixture
) -> None:
    ahead.unsupported[0] = "it runs tensor parallel (2 ranks)"
    req, scheduler = parked(ahead, 1, 2, 3)
    ahead.receiver.layers[ROOM] = 1
    ahead.decoder.step(scheduler)
    ahead.receiver.layers[ROOM] = 2
    ahead.decoder.step(scheduler)
    assert ahead.advanced == [] and caplog.text.count("tensor parallel") == 1  # checked once
    ahead.receiver.verdicts[ROOM] = (Verdict.READY, None)
    ahead.logits.append(choosing(1, 2, 3))
    ahead.decoder.step(scheduler)
    assert ahead.forwarded == [["a"]] and req.output_ids == [7, 1, 2, 3]  # in steps


def test_rows_that_fail_to_run_ahead_verify_in_steps(
    ahead: SimpleNamespace, caplog: pytest.LogCaptureFixture
) -> None:
    req, scheduler = parked(ahead, 1, 2, 3)
    ahead.receiver.layers[ROOM] = 1
    ahead.layerwise_logits.append(RuntimeError("a bug"))
    ahead.decoder.step(scheduler)
    assert "layer by layer failed" in caplog.text
    ahead.layerwise_logits.clear()
    ahead.receiver.verdicts[ROOM] = (Verdict.READY, None)
    ahead.logits.append(choosing(1, 2, 3))
    ahead.decoder.step(scheduler)
    assert ahead.advanced == [("a", 0, 1)] and ahead.forwarded == [["a"]]
    assert req.output_ids == [7, 1, 2, 3]


def test_overlap_rows_run_ahead_after_the_step_in_flight_with_its_late_token(
    ahead: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    ahead.decoder = SpeculativeDecoder(
        ahead.engine,
        ahead.receiver,
        max_tokens=4,
        page_size=1,
        metrics=None,
        verify_pass="layers",
        overlap=True,
    )  # type: ignore[arg-type]  # cap 3 and the late token
    req, scheduler = parked(ahead, 1, 2, 3)

    def process_in_flight_batch(scheduler: Any) -> None:  # the step launched before it parked
        if len(req.output_ids) == 4:
            req.decode_one(ahead.decoder, 4)

    ahead.engine.in_flight = process_in_flight_batch
    ahead.receiver.layers[ROOM] = 1
    ahead.decoder.step(scheduler)
    assert ahead.advanced == [("a", 0, 1)] and req.output_ids == [7, 1, 2, 3, 4]
    assert ahead.decoder.speculations.of(req).layerwise.batches == [0, 1, 2, 3]  # type: ignore[union-attr]
