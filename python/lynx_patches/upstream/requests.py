"""Requests: the fields Lynx reads and writes, sampling and logprob settings, the
request-level info in ``meta_info``, and the tokenizer's parallel samples."""

from __future__ import annotations

from collections.abc import Sequence
from http import HTTPStatus
from typing import Any

from lynx.verify import CommittedLogprobs, LogprobRequest, SamplingSettings
from lynx_patches.upstream.contract import REQ, SCHEDULE_BATCH, SCHEDULER, Relied, attribute, method, relies

_ACCUMULATOR = "sglang.srt.managers.scheduler_components.output_streamer._GenerationStreamAccumulator"
_TOKENIZER_MANAGER = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
_GENERATE_INPUT = "sglang.srt.managers.io_struct.GenerateReqInput"
_TOKENIZED_INPUT = "sglang.srt.managers.io_struct.TokenizedGenerateReqInput"
_BATCH_RESULT_PROCESSOR = (
    "sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor"
)
# A request's per-output-token logprob lists (``Req.logprob``), one entry per output token.
_OUTPUT_LOGPROB_FIELDS = (
    "output_token_logprobs_val",
    "output_token_logprobs_idx",
    "output_top_logprobs_val",
    "output_top_logprobs_idx",
    "output_token_ids_logprobs_val",
    "output_token_ids_logprobs_idx",
)
# Upstream counts reasoning tokens as it appends each output token, in a small state
# machine on the request (the end-of-thinking matcher); a rollback restores it and replays
# the committed tokens, so usage counts exactly the tokens the client receives.
_REASONING_FIELDS = (
    "reasoning_tokens",
    "_is_reasoning_over",
    "_think_end_matcher",
    "_think_end_match_len",
    "_think_start_match_len",
)

RELIED: tuple[Relied, ...] = (
    # What the accessors below do not declare themselves: the request fields hook
    # modules read directly, the reasoning-count fields the accessors reach by name, and
    # the methods Lynx's hooks wrap.
    method(SCHEDULER, "pause_generation", "recv_req"),
    method(REQ, "update_finish_state", "new_accepted_len"),
    method(
        "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer",
        "is_request_level_customized_info_key",
        "key",
    ),
    method(_ACCUMULATOR, "accept", "req"),
    method(_TOKENIZER_MANAGER, "_handle_batch_request", "obj", "request", "request_states"),
    method(_TOKENIZER_MANAGER, "_send_one_request", "tokenized_obj"),
)


@relies(
    attribute(REQ, "sampling_params"),
    attribute(REQ, "grammar"),
    attribute(REQ, "custom_logit_processor"),
    attribute(REQ, "return_hidden_states"),
    attribute(REQ, "return_sampling_mask"),
    attribute(REQ, "return_routed_experts"),
    attribute(REQ, "return_indexer_topk"),
    attribute("sglang.srt.sampling.sampling_params.SamplingParams", "temperature"),
    attribute("sglang.srt.sampling.sampling_params.SamplingParams", "top_k"),
    attribute("sglang.srt.sampling.sampling_params.SamplingParams", "top_p"),
    attribute("sglang.srt.sampling.sampling_params.SamplingParams", "min_p"),
    attribute("sglang.srt.sampling.sampling_params.SamplingParams", "frequency_penalty"),
    attribute("sglang.srt.sampling.sampling_params.SamplingParams", "presence_penalty"),
    attribute("sglang.srt.sampling.sampling_params.SamplingParams", "repetition_penalty"),
    attribute("sglang.srt.sampling.sampling_params.SamplingParams", "min_new_tokens"),
    attribute("sglang.srt.sampling.sampling_params.SamplingParams", "logit_bias"),
    attribute("sglang.srt.sampling.sampling_params.SamplingParams", "watermark"),
)
def sampling_settings(req: Any, vocab: int) -> SamplingSettings:
    params = req.sampling_params
    return SamplingSettings(
        temperature=float(params.temperature),
        top_k=int(params.top_k),
        top_p=float(params.top_p),
        min_p=float(params.min_p),
        vocab_size=vocab,
        logprobs=logprob_request(req),
        grammar=req.grammar is not None,
        penalties=bool(
            params.frequency_penalty or params.presence_penalty or params.repetition_penalty != 1.0
        ),
        min_new_tokens=bool(params.min_new_tokens),
        logit_bias=bool(params.logit_bias),
        custom_logit_processor=getattr(req, "custom_logit_processor", None) is not None,
        hidden_states=bool(getattr(req, "return_hidden_states", False)),
        watermark=params.watermark is not None,
        per_token_outputs=bool(
            req.return_sampling_mask or req.return_routed_experts or req.return_indexer_topk
        ),
    )


@relies(
    attribute(REQ, "sampling_params"),
    attribute(REQ, "return_logprob"),
    attribute(REQ, "logprob"),
    attribute(f"{SCHEDULE_BATCH}.ReqLogprob", "top_logprobs_num"),
    attribute(f"{SCHEDULE_BATCH}.ReqLogprob", "token_ids_logprob"),
    attribute("sglang.srt.sampling.sampling_params.SamplingParams", "temperature"),
)
def logprob_request(req: Any) -> LogprobRequest | None:
    """What ``req`` asked to get back per output token, as upstream's sampler computes it
    (the request's temperature, unless ``SGLANG_RETURN_ORIGINAL_LOGPROB``); None without
    ``return_logprob``."""
    if not req.return_logprob:
        return None
    token_ids = req.logprob.token_ids_logprob
    return LogprobRequest(
        top_n=int(req.logprob.top_logprobs_num),
        token_ids=None if token_ids is None else tuple(int(t) for t in token_ids),
        temperature=1.0 if returns_original_logprobs() else float(req.sampling_params.temperature),
    )


@relies(Relied("sglang.srt.layers.sampler", "SGLANG_RETURN_ORIGINAL_LOGPROB", "member"))
def returns_original_logprobs() -> bool:
    """Upstream's sampler returns logprobs before temperature scaling
    (``SGLANG_RETURN_ORIGINAL_LOGPROB``)."""
    from sglang.srt.layers import sampler

    return bool(sampler.SGLANG_RETURN_ORIGINAL_LOGPROB)


@relies(
    attribute(REQ, "logprob"),
    attribute(f"{SCHEDULE_BATCH}.ReqLogprob", "output_token_logprobs_val"),
    attribute(f"{SCHEDULE_BATCH}.ReqLogprob", "output_token_logprobs_idx"),
    attribute(f"{SCHEDULE_BATCH}.ReqLogprob", "output_top_logprobs_val"),
    attribute(f"{SCHEDULE_BATCH}.ReqLogprob", "output_top_logprobs_idx"),
    attribute(f"{SCHEDULE_BATCH}.ReqLogprob", "output_token_ids_logprobs_val"),
    attribute(f"{SCHEDULE_BATCH}.ReqLogprob", "output_token_ids_logprobs_idx"),
)
def replace_output_logprobs(req: Any, keep: int, committed: CommittedLogprobs) -> None:
    """Keep the first ``keep`` entries of each per-output-token logprob list (``t_0``'s,
    from prefill) and append ``committed``'s after them."""
    lists = req.logprob
    for name in _OUTPUT_LOGPROB_FIELDS:
        del getattr(lists, name)[keep:]
    lists.output_token_logprobs_val.extend(committed.token_val)
    lists.output_token_logprobs_idx.extend(committed.token_idx)
    lists.output_top_logprobs_val.extend(committed.top_val)
    lists.output_top_logprobs_idx.extend(committed.top_idx)
    lists.output_token_ids_logprobs_val.extend(committed.ids_val)
    lists.output_token_ids_logprobs_idx.extend(committed.ids_idx)


@relies(*(attribute(REQ, name) for name in _REASONING_FIELDS))
def reasoning_state(req: Any) -> tuple[Any, ...]:
    return tuple(getattr(req, name) for name in _REASONING_FIELDS)


@relies(
    *(attribute(REQ, name) for name in _REASONING_FIELDS),
    attribute(SCHEDULER, "batch_result_processor"),
    method(_BATCH_RESULT_PROCESSOR, "_maybe_update_reasoning_tokens", "req", "next_token_id"),
)
def recount_reasoning(scheduler: Any, req: Any, state: tuple[Any, ...], tokens: Sequence[int]) -> None:
    """Restore the reasoning count to ``state`` and count ``tokens`` on top, as upstream
    counts decoded tokens."""
    for name, value in zip(_REASONING_FIELDS, state, strict=True):
        setattr(req, name, value)
    if tokens:
        scheduler.batch_result_processor._maybe_update_reasoning_tokens(req, list(tokens))


@relies(attribute(REQ, "customized_info"))
def set_request_info(req: Any, key: str, value: dict[str, Any]) -> None:
    """Put ``value`` into the response's ``meta_info[key]`` (upstream's request-level
    customized info: one entry per request)."""
    if req.customized_info is None:
        req.customized_info = {}
    req.customized_info[key] = [value]


@relies(attribute(REQ, "send_token_offset"))
def first_stream_chunk(req: Any) -> bool:
    """No token of ``req`` has been streamed yet (its next output is its first chunk)."""
    return req.send_token_offset == 0


@relies(attribute(REQ, "send_token_offset"), attribute(REQ, "output_ids"), method(REQ, "finished"))
def streamed_every_token(req: Any) -> bool:
    """``req`` is not finished and has streamed every token it has (its next chunk would
    carry none)."""
    return not req.finished() and req.send_token_offset >= len(req.output_ids)


@relies(
    attribute(REQ, "customized_info"),
    method(REQ, "finished"),
    attribute(_ACCUMULATOR, "output_reqs"),
    attribute(_ACCUMULATOR, "customized_info"),
    attribute(REQ, "stream"),
)
def resend_request_info(accumulator: Any, req: Any, key: str) -> None:
    """Upstream sends a streamed request's request-level info (``key``) with its first
    chunk only. When ``req`` has just been taken into ``accumulator`` (an output batch) as
    finished, add its current value to that batch too: the tokenizer appends it to what the
    first chunk carried, so the last chunk's ``meta_info[key]`` ends with the final value."""
    value = (req.customized_info or {}).get(key)
    if not (req.stream and req.finished() and value) or not accumulator.output_reqs:
        return
    if accumulator.output_reqs[-1] is not req:
        return  # not output in this batch (a beam upstream held back)
    column = accumulator.customized_info.setdefault(key, [[] for _ in accumulator.output_reqs])
    column[-1] = list(value)


# ---- Tokenizer: parallel samples -------------------------------------------------------------


@relies(
    attribute(_GENERATE_INPUT, "parallel_sample_num"),
    attribute(_GENERATE_INPUT, "bootstrap_room"),
    attribute(_GENERATE_INPUT, "batch_size"),
)
def parallel_sample_rooms(obj: Any) -> list[int] | None:
    """The bootstrap rooms of the prompts of a (normalized) generate request that upstream's
    tokenizer will send as ``n`` > 1 parallel samples, or None: one sample per prompt, no
    room (not a PD request), or not a generate request."""
    if getattr(obj, "parallel_sample_num", 1) <= 1:
        return None
    rooms = getattr(obj, "bootstrap_room", None)
    # Normalized: one room per expanded sample, the prompts' first (``obj[i]`` reads room i).
    prompts = rooms[: obj.batch_size] if isinstance(rooms, list) else [rooms]
    if any(room is None for room in prompts):
        return None
    return [int(room) for room in prompts]


@relies(attribute(_TOKENIZED_INPUT, "bootstrap_room"))
def tokenized_room(tokenized_obj: Any) -> int | None:
    """The bootstrap room a tokenized request is about to be sent to the scheduler with."""
    return getattr(tokenized_obj, "bootstrap_room", None)


@relies(attribute(_TOKENIZED_INPUT, "bootstrap_room"))
def send_with_room(tokenized_obj: Any, room: int) -> None:
    tokenized_obj.bootstrap_room = room


@relies(
    attribute(REQ, "sampling_params"),
    attribute("sglang.srt.sampling.sampling_params.SamplingParams", "max_new_tokens"),
)
def max_new_tokens(req: Any) -> int | None:
    """The most tokens the request may generate (None: no limit)."""
    return req.sampling_params.max_new_tokens


@relies(attribute(REQ, "to_finish"))
def is_aborting(req: Any) -> bool:
    """An abort (client or server) is pending on the request."""
    return req.to_finish is not None


@relies(attribute(REQ, "to_finish"), Relied(SCHEDULE_BATCH, "FINISH_ABORT", "class"))
def abort_with(req: Any, reason: str) -> None:
    """Finish the request at its next finish check with ``reason`` (HTTP 500)."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    req.to_finish = FINISH_ABORT(reason, HTTPStatus.INTERNAL_SERVER_ERROR)


@relies(attribute(REQ, "finished_reason"), attribute(REQ, "finished_len"))
def clear_finish(req: Any) -> None:
    """Undo a finish upstream's check just set (it is deferred until verification)."""
    req.finished_reason = None
    req.finished_len = None


@relies(attribute(REQ, "output_ids"))
def output_ids(req: Any) -> list[int]:
    """Its output tokens: the first, from prefill, then those decoded."""
    return req.output_ids


@relies(attribute(REQ, "origin_input_ids"))
def prompt_len(req: Any) -> int:
    return len(req.origin_input_ids)


@relies(attribute(REQ, "rid"))
def request_id(req: Any) -> str:
    return str(req.rid)


@relies(method(REQ, "finished"))
def is_finished(req: Any) -> bool:
    return bool(req.finished())


@relies(method(REQ, "update_finish_state", "new_accepted_len"))
def update_finish_state(req: Any, new_tokens: int) -> None:
    """Upstream's finish check over the request's last ``new_tokens`` output tokens."""
    req.update_finish_state(new_accepted_len=new_tokens)


@relies(attribute(REQ, "output_ids"))
def truncate_output(req: Any, keep: int) -> None:
    """Keep the first ``keep`` output tokens."""
    del req.output_ids[keep:]


@relies(attribute(REQ, "output_ids"))
def append_output(req: Any, token: int) -> None:
    req.output_ids.append(token)


@relies(attribute(REQ, "kv"), attribute(f"{SCHEDULE_BATCH}.ReqKvInfo", "kv_allocated_len"))
def kv_allocated_len(req: Any) -> int:
    return int(req.kv.kv_allocated_len)


@relies(attribute(REQ, "bootstrap_room"))
def bootstrap_room(req: Any) -> int | None:
    """The room of the request's PD transfer (None outside PD)."""
    return req.bootstrap_room


@relies(attribute(REQ, "kv"), attribute(f"{SCHEDULE_BATCH}.ReqKvInfo", "req_pool_idx"))
def req_pool_row(req: Any) -> int:
    return int(req.kv.req_pool_idx)


@relies(
    attribute(REQ, "kv"),
    attribute(f"{SCHEDULE_BATCH}.ReqKvInfo", "kv_committed_len"),
    attribute(f"{SCHEDULE_BATCH}.ReqKvInfo", "kv_allocated_len"),
    method("sglang.srt.mem_cache.base_prefix_cache.BasePrefixCache", "free_kv_row", "kv", "ranges"),
    attribute(SCHEDULER, "tree_cache"),
)
def set_kv_len(scheduler: Any, req: Any, kept: int, free: tuple[int, int] | None) -> None:
    """The request's KV now ends at ``kept`` tokens; ``free`` ([start, end), page-aligned) goes back to
    the pool."""
    if free is not None:
        scheduler.tree_cache.free_kv_row(req.kv, [free])
    req.kv.kv_committed_len = req.kv.kv_allocated_len = kept
