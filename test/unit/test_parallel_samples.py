"""Each parallel sample (``n`` > 1) gets its own bootstrap room, named alike on both servers."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from lynx import settings
from lynx.transfer.parallel_samples import ParallelSampleRooms, decode_reads_prompt_kv, sample_room
from lynx_patches import tokenizer_manager


def test_sample_rooms_are_distinct_63_bit_and_fixed() -> None:
    rooms = [sample_room(room, k) for room in (0, 1, 2, 2**63 - 1, 2**64 - 1) for k in range(1, 9)]
    assert len(set(rooms)) == len(rooms)
    assert all(0 <= room < 2**63 for room in rooms)
    # Neither the prompt's room nor the rooms upstream numbers a batch with (room + i).
    assert not {sample_room(1000, k) for k in range(1, 9)} & set(range(1000, 1009))
    # Pinned: both servers (and any release of Lynx they run) must derive the same room.
    assert sample_room(42, 1) == sample_room(42, 1) == 2556810480704848937


@pytest.mark.parametrize(("room", "sample"), [(-1, 1), (2**64, 1), (5, 0)])
def test_sample_room_refuses_what_is_not_a_room_or_a_sample(room: int, sample: int) -> None:
    with pytest.raises(ValueError):
        sample_room(room, sample)


def test_the_first_send_of_a_room_is_the_warmup_then_each_sample_its_own_room() -> None:
    rooms = ParallelSampleRooms()
    rooms.begin([7, 9])
    # Upstream sends every prompt's warm-up first, then each prompt's samples in turn.
    sends = [rooms.next_send(room) for room in (7, 9, 7, 7, 7, 9, 9, 9)]
    assert sends == [
        None,  # the warm-ups keep the prompt's room
        None,
        *(sample_room(7, k) for k in (1, 2, 3)),
        *(sample_room(9, k) for k in (1, 2, 3)),
    ]
    assert rooms.next_send(8) is None and rooms.next_send(None) is None
    rooms.end([7, 9])
    assert rooms.in_flight() == 0 and rooms.next_send(7) is None


def test_only_a_request_of_no_new_tokens_on_a_decode_without_radix_cache_needs_no_prompt_kv() -> None:
    assert not decode_reads_prompt_kv(0, decode_radix_cache=False)  # the warm-up: read by nobody
    assert decode_reads_prompt_kv(0, decode_radix_cache=True)  # kept for the samples
    for max_new_tokens in (1, 128, None):
        assert decode_reads_prompt_kv(max_new_tokens, decode_radix_cache=False)


def test_two_requests_with_one_room_are_refused_by_name() -> None:
    rooms = ParallelSampleRooms()
    rooms.begin([7])
    with pytest.raises(ValueError, match=r"room\(s\) \[7\] already belong"):
        rooms.begin([7, 8])
    with pytest.raises(ValueError, match=r"\[5\]"):
        rooms.begin([5, 5])
    assert rooms.in_flight() == 1  # nothing of a refused request was registered


# ---- the tokenizer hooks, over a stand-in for upstream's send order ----------------------


class _Tokenizer:
    """Sends as upstream's ``_handle_batch_request`` does for ``n`` > 1: per prompt a
    warm-up, then per prompt its samples, each a copy of the prompt's tokenized request."""

    def __init__(self) -> None:
        self.sent: list[SimpleNamespace] = []

    def send(self, tokenized_obj: SimpleNamespace) -> None:
        tokenizer_manager._name_the_send(self, tokenized_obj)
        self.sent.append(tokenized_obj)

    async def handle_batch(self, obj: SimpleNamespace) -> Any:
        prompts = obj.bootstrap_room[: obj.batch_size]
        for room in prompts:
            self.send(SimpleNamespace(bootstrap_room=room, bootstrap_host="10.0.0.1", max_new_tokens=0))
        for room in prompts:
            for _ in range(obj.parallel_sample_num):
                self.send(SimpleNamespace(bootstrap_room=room, bootstrap_host="10.0.0.1", max_new_tokens=8))
        yield [len(self.sent)]


def _answer(tokenizer: _Tokenizer, obj: SimpleNamespace) -> list[Any]:
    async def collect() -> list[Any]:
        answers = tokenizer_manager._samples_get_their_own_rooms(_Tokenizer.handle_batch, tokenizer, obj)
        return [answer async for answer in answers]

    return asyncio.run(collect())


def _request(rooms: list[int], n: int) -> SimpleNamespace:
    # Normalized as upstream's GenerateReqInput does: one room per expanded sample.
    return SimpleNamespace(parallel_sample_num=n, batch_size=len(rooms), bootstrap_room=rooms * n)


@pytest.fixture
def lynx_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(settings.SETTINGS_ENV, settings.LynxSettings().to_json())


@pytest.mark.usefixtures("lynx_on")
def test_with_lynx_each_sample_is_sent_with_its_own_room_and_the_warmup_with_the_prompts() -> None:
    tokenizer = _Tokenizer()
    _answer(tokenizer, _request([11, 12], n=3))
    warmups, samples = tokenizer.sent[:2], tokenizer.sent[2:]
    assert [(w.bootstrap_room, w.bootstrap_host) for w in warmups] == [(11, "10.0.0.1"), (12, "10.0.0.1")]
    assert [s.bootstrap_room for s in samples] == [sample_room(r, k) for r in (11, 12) for k in (1, 2, 3)]
    assert {s.bootstrap_host for s in samples} == {"10.0.0.1"}
    assert tokenizer_manager._ROOMS.in_flight() == 0  # forgotten once answered


@pytest.mark.usefixtures("lynx_on")
def test_a_request_closed_before_its_answer_forgets_its_rooms() -> None:
    tokenizer = _Tokenizer()

    async def hang_up() -> None:
        answers = tokenizer_manager._samples_get_their_own_rooms(
            _Tokenizer.handle_batch, tokenizer, _request([3], 2)
        )
        await answers.__anext__()
        assert tokenizer_manager._ROOMS.in_flight() == 1
        await answers.aclose()

    asyncio.run(hang_up())
    assert tokenizer_manager._ROOMS.in_flight() == 0


@pytest.mark.parametrize(
    "obj",
    [
        _request([11], n=1),  # one sample: upstream's own path
        SimpleNamespace(parallel_sample_num=3, batch_size=1, bootstrap_room=[None] * 3),  # not PD
        SimpleNamespace(text="an embedding request has no samples"),
    ],
)
@pytest.mark.usefixtures("lynx_on")
def test_requests_that_are_not_parallel_pd_samples_are_left_alone(obj: SimpleNamespace) -> None:
    original = object()
    assert tokenizer_manager._samples_get_their_own_rooms(lambda *_: original, None, obj) is original


def test_without_lynx_upstream_sends_every_sample_with_the_prompts_room(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(settings.SETTINGS_ENV, raising=False)
    tokenizer = _Tokenizer()
    _answer(tokenizer, _request([11], n=3))
    assert [(s.bootstrap_room, s.bootstrap_host) for s in tokenizer.sent] == [(11, "10.0.0.1")] * 4
