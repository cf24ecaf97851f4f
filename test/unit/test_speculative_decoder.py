"""The speculative decoder's glue logic (``lynx_patches.speculative_decoder``) on stand-ins
of SGLang's request, batch and scheduler: admission, holding, parking, verification,
commit and rollback. The real objects are exercised end to end in
``test/e2e/test_lynx_speculative.py``; these stand-ins carry only the fields
``lynx_patches.upstream`` reads and writes."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from lynx.codec import CodecConfig, KVLayout
from lynx.mode import Mode
from lynx.transfer import Handshake, RoomReport, Verdict
from lynx.verify import ParkReason, SpecState
from lynx_patches import upstream
from lynx_patches.speculative_decoder import META_INFO_KEY, SpeculativeDecoder

VOCAB, PROMPT, ROOM = 16, 5, 11


class Receiver:
    handshake = Handshake(Mode.SPECULATIVE, CodecConfig(), KVLayout(2, 2, 64, torch.bfloat16))

    def __init__(self) -> None:
        self.verdicts: dict[int, tuple[Verdict, str | None]] = {}
        self.written: list[int] = []
        self.forgotten: list[int] = []

    def report(self, room: int) -> RoomReport:
        return RoomReport(100, 0, 0.1, None)

    def residual_verdict(self, room: int) -> tuple[Verdict, str | None]:
        return self.verdicts.get(room, (Verdict.WAIT, None))

    def write_kv(self, room: int, slots: torch.Tensor) -> bool:
        self.written.append(room)
        return True

    def forget(self, room: int) -> RoomReport:
        self.forgotten.append(room)
        return RoomReport(100, 300, 0.1, 0.9)


class Req:
    def __init__(self, rid: str, **sampling: Any) -> None:
        self.rid = rid
        self.origin_input_ids = list(range(PROMPT))
        self.output_ids = [7]  # t_0, from prefill
        params = {"temperature": 1.0, "top_k": 1, "top_p": 1.0, "min_p": 0.0, **sampling}
        self.sampling_params = SimpleNamespace(
            **params,
            frequency_penalty=0.0,
            presence_penalty=0.0,
            repetition_penalty=1.0,
            min_new_tokens=0,
            logit_bias=None,
        )
        self.return_logprob = False
        self.grammar = None
        self.to_finish: str | None = None
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
        decoder.hold(self, token)


class Batch:
    def __init__(self, reqs: list[Any]) -> None:
        self.reqs = reqs

    def filter_batch(self, keep_indices: list[int]) -> None:
        self.reqs = [self.reqs[i] for i in keep_indices]


class Scheduler:
    def __init__(self, reqs: list[Any]) -> None:
        self.running_batch = Batch(reqs)
        self.waiting_queue: list[Any] = []
        self.freed: list[tuple[int, int]] = []
        self.tree_cache = SimpleNamespace(free_kv_row=lambda kv, ranges: self.freed.extend(ranges))


@pytest.fixture
def world(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    answered: list[Any] = []
    verify_logits: list[torch.Tensor] = []
    monkeypatch.setattr(upstream, "run_verify_forward", lambda scheduler, reqs, lens: list(verify_logits))
    monkeypatch.setattr(upstream, "release_and_answer", lambda scheduler, req: answered.append(req))
    monkeypatch.setattr(upstream, "abort_with", lambda req, reason: setattr(req, "to_finish", reason))
    receiver = Receiver()
    decoder = SpeculativeDecoder(receiver, max_tokens=3, page_size=1, metrics=None)  # type: ignore[arg-type]
    return SimpleNamespace(receiver=receiver, decoder=decoder, answered=answered, logits=verify_logits)


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
    assert world.decoder.is_speculating(req) and not world.decoder.holds_tokens(req)  # t_0 streams
    for token in (1, 2, 3):
        req.decode_one(world.decoder, token)
    assert not world.decoder.is_speculating(req) and world.decoder.holds_tokens(req)
    world.decoder.step(scheduler)  # the Residual is still in flight
    assert scheduler.running_batch.reqs == [] and list(world.decoder.parked_requests()) == [req]
    assert world.decoder.holds_kv_outside_batches()


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
    stats = world.decoder.stats
    assert (stats.held_tokens, stats.accepted_tokens, stats.rejections, stats.active) == (3, 1, 1, 0)
    assert world.decoder.speculation_of(req) is None and not world.decoder.holds_tokens(req)


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


def test_settings_it_cannot_verify_wait_for_the_residual(world: SimpleNamespace) -> None:
    req = Req("a")
    req.return_logprob = True  # logprobs of held tokens are not rebuilt yet
    scheduler = admitted(world, req)
    spec = world.decoder.speculation_of(req)
    assert spec is not None and spec.held.state is SpecState.PARKED
    assert spec.held.park_reason is ParkReason.UNVERIFIABLE and world.decoder.stats.waited == 1
    world.receiver.verdicts[ROOM] = (Verdict.READY, None)
    world.decoder.step(scheduler)
    assert req.output_ids == [7] and scheduler.waiting_queue == [req]  # refined, nothing to verify
    assert req.customized_info[META_INFO_KEY][0]["speculation"]["held"] == 0  # type: ignore[index]


def test_sampled_requests_keep_their_draft_distributions(world: SimpleNamespace) -> None:
    req = Req("s", top_k=VOCAB, temperature=0.5)
    admitted(world, req)
    spec = world.decoder.speculation_of(req)
    assert spec is not None and spec.sampled
    assert world.decoder.sampled_rows() == {3: spec}
    with pytest.raises(RuntimeError, match="draft distribution was not kept"):
        req.decode_one(world.decoder, 1)
    spec.pending_probs = torch.full((VOCAB,), 1.0 / VOCAB)
    req.decode_one(world.decoder, 2)
    assert spec.held.tokens == [2] and spec.pending_probs is None
