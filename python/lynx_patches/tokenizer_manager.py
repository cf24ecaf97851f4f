"""Parallel samples (``n`` > 1) through PD with ``--lynx``: each sample its own room.

Upstream's tokenizer sends a request's warm-up and its ``n`` samples to the scheduler
with the prompt's one bootstrap room; :mod:`lynx.transfer.parallel_samples` says why
that cannot pair and how both servers rename the sends alike.

Hook targets (``sglang.srt.`` omitted):
* ``managers.tokenizer_manager.TokenizerManager._handle_batch_request`` AROUND: with
  ``--lynx``, a request with ``n`` > 1 and bootstrap rooms registers its prompts' rooms
  for as long as it is answered (streamed or not; a client that hangs up closes it).
* ``managers.tokenizer_manager.TokenizerManager._send_one_request`` BEFORE: a sample whose
  prompt's room is registered gets its own room (the warm-up keeps the prompt's).

Contract: the tokenizer's event loop (the launcher process), once per request and once
per send. Without ``--lynx`` nothing is registered and every send is left as upstream
made it: plain upstream PD gives every sample the prompt's room (and hangs, as the
README's feature table says).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from lynx import settings
from lynx.transfer.parallel_samples import ParallelSampleRooms
from lynx_patches import upstream
from lynx_patches._hooks import hook

TOKENIZER_MANAGER = "managers.tokenizer_manager.TokenizerManager"

# This process's parallel-sampling requests in flight (one tokenizer per server process).
_ROOMS = ParallelSampleRooms()


def _samples_get_their_own_rooms(original: Any, manager: Any, obj: Any, *args: Any, **kwargs: Any) -> Any:
    answers = original(manager, obj, *args, **kwargs)
    rooms = upstream.parallel_sample_rooms(obj)
    if rooms is None or settings.current() is None:
        return answers
    return _while_answering(answers, rooms)


async def _while_answering(answers: AsyncIterator[Any], rooms: list[int]) -> AsyncIterator[Any]:
    _ROOMS.begin(rooms)
    try:
        async for answer in answers:
            yield answer
    finally:
        _ROOMS.end(rooms)


def _name_the_send(manager: Any, *args: Any, **kwargs: Any) -> None:
    tokenized_obj = kwargs["tokenized_obj"] if "tokenized_obj" in kwargs else args[0]
    room = _ROOMS.next_send(upstream.tokenized_room(tokenized_obj))
    if room is not None:
        upstream.send_with_room(tokenized_obj, room)


def register() -> None:
    hook(TOKENIZER_MANAGER + "._handle_batch_request", _samples_get_their_own_rooms, "around")
    hook(TOKENIZER_MANAGER + "._send_one_request", _name_the_send, "before")
