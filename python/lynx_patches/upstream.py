"""The one boundary between Lynx and SGLang's internals (``sglang==0.5.23``).

Every private attribute, message frame position, batch construction and field write
Lynx relies on is a named function here; the rest of ``lynx_patches`` calls these and
reads only the public request fields listed in :data:`CONTRACT`. ``CONTRACT`` names each
upstream symbol and attribute these functions use; ``test/plugin/test_upstream_contract.py``
checks every entry (and the metadata frame layout) against the installed SGLang, so an
upgrade that moves one fails a test naming it instead of a request at run time, and
``test/unit/test_boundary_contract.py`` reads this module's source and fails on any
upstream attribute, method, keyword or positional argument used here and not declared.

SGLang is imported inside the functions: this module is imported at plugin registration,
before SGLang may be.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import torch

from lynx.transfer import Upstream
from lynx.verify import CommittedLogprobs, LogprobRequest, SamplingSettings
from lynx_patches.errors import LynxConfigError

CONN = "sglang.srt.disaggregation.mooncake.conn"
COMMON_CONN = "sglang.srt.disaggregation.common.conn"
BASE_CONN = "sglang.srt.disaggregation.base.conn"
SCHEDULE_BATCH = "sglang.srt.managers.schedule_batch"
TRANSFER_ENGINE = (
    "sglang.srt.distributed.device_communicators.mooncake_transfer_engine.MooncakeTransferEngine"
)


@dataclass(frozen=True)
class Relied:
    """One upstream name Lynx relies on: ``owner`` (a module or a class, dotted) and the
    ``name`` in it; ``kind`` is ``function``/``class``/``member`` (module-level, or an enum
    member), ``method`` (on the class, with at least ``params``), or ``attribute`` (set on
    instances: ``self.<name> = ...`` somewhere in the class or its bases)."""

    owner: str
    name: str
    kind: str
    params: tuple[str, ...] = ()


def _m(owner: str, name: str, *params: str) -> Relied:
    return Relied(owner, name, "method", params)


def _a(owner: str, name: str) -> Relied:
    return Relied(owner, name, "attribute")


_MANAGER = f"{CONN}.MooncakeKVManager"
_RECEIVER = f"{CONN}.MooncakeKVReceiver"
_SENDER = f"{CONN}.MooncakeKVSender"
_REQ = f"{SCHEDULE_BATCH}.Req"
_BATCH = f"{SCHEDULE_BATCH}.ScheduleBatch"
_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
_ACCUMULATOR = "sglang.srt.managers.scheduler_components.output_streamer._GenerationStreamAccumulator"
_TOKENIZER_MANAGER = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
_GENERATE_INPUT = "sglang.srt.managers.io_struct.GenerateReqInput"
_TOKENIZED_INPUT = "sglang.srt.managers.io_struct.TokenizedGenerateReqInput"
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

CONTRACT: tuple[Relied, ...] = (
    # The plugin API the hooks register through (lynx_patches._hooks).
    Relied("sglang.srt.plugins.hook_registry", "HookRegistry", "class"),
    Relied("sglang.srt.plugins.hook_registry", "HookType", "class"),
    _m("sglang.srt.plugins.hook_registry.HookRegistry", "register", "target", "hook", "hook_type"),
    # Mooncake connector: what Lynx's subclasses read, call and override.
    Relied(BASE_CONN, "KVPoll", "class"),
    Relied(f"{BASE_CONN}.KVPoll", "Success", "member"),
    Relied(f"{BASE_CONN}.KVPoll", "Failed", "member"),
    Relied(f"{BASE_CONN}.KVPoll", "Transferring", "member"),
    Relied(f"{BASE_CONN}.KVPoll", "WaitingForInput", "member"),
    Relied(COMMON_CONN, "ABORT_TAG", "member"),
    Relied(COMMON_CONN, "AbortNotification", "class"),
    Relied(COMMON_CONN, "KVTransferError", "class"),
    _m(f"{COMMON_CONN}.AbortNotification", "from_zmq", "msg"),
    _a(f"{COMMON_CONN}.AbortNotification", "room"),
    Relied("sglang.srt.utils.network", "NetworkAddress", "class"),
    _m("sglang.srt.utils.network.NetworkAddress", "to_tcp"),
    _m("sglang.srt.utils.network.NetworkAddress", "is_ipv6"),
    _a(f"{CONN}.TransferInfo", "is_dummy"),
    # What upstream's control threads read, checked ahead by unreadable_peer_message.
    _m(f"{CONN}.TransferInfo", "from_zmq", "msg"),
    _m(f"{CONN}.KVArgsRegisterInfo", "from_zmq", "msg"),
    _m(_MANAGER, "start_prefill_thread"),
    _m(_MANAGER, "start_decode_thread"),
    _m(_MANAGER, "_handle_aux_data", "msg"),
    _a(_MANAGER, "_staging_ctx"),
    Relied("sglang.srt.disaggregation.common.staging_handler", "handle_watermark_msg", "function"),
    Relied("sglang.srt.disaggregation.common.staging_handler", "handle_staging_rsp", "function"),
    _a(f"{BASE_CONN}.KVArgs", "page_size"),
    _a(f"{BASE_CONN}.KVArgs", "engine_rank"),
    Relied("sglang.srt.disaggregation.utils", "DisaggregationMode", "class"),
    Relied("sglang.srt.disaggregation.utils.DisaggregationMode", "PREFILL", "member"),
    _m(_MANAGER, "__init__", "args", "disaggregation_mode", "server_args", "is_mla_backend"),
    _m(_MANAGER, "_make_worker_recv", "socket", "timeout_ms"),
    _a(f"{COMMON_CONN}.CommonKVManager", "local_ip"),
    _a(f"{COMMON_CONN}.CommonKVManager", "rank_port"),
    _m(_MANAGER, "_send_multipart_locked", "endpoint", "parts", "is_ipv6"),
    _m(_MANAGER, "_handle_abort_notification", "msg"),
    _m(_MANAGER, "_handle_node_failure", "failed_bootstrap_addr"),
    _m(_MANAGER, "add_transfer_request", "bootstrap_room", "kv_indices", "index_slice", "is_last_chunk"),
    _m(_MANAGER, "build_receiver_metadata_message", "bootstrap_room", "is_dummy"),
    _m(_MANAGER, "check_status", "bootstrap_room"),
    _m(_MANAGER, "conclude_failure", "bootstrap_room", "failure_reason"),
    _m(_MANAGER, "record_failure", "bootstrap_room", "failure_reason"),
    _m(_MANAGER, "update_status", "bootstrap_room", "status"),
    _m(_MANAGER, "teardown"),
    _a(_MANAGER, "request_status"),
    _a(_MANAGER, "transfer_infos"),
    _a(_MANAGER, "engine"),
    _a(_MANAGER, "kv_args"),
    _a(_MANAGER, "server_args"),
    _a(_MANAGER, "disaggregation_mode"),
    _a(_MANAGER, "is_mla_backend"),
    _m(TRANSFER_ENGINE, "get_session_id"),
    _m(TRANSFER_ENGINE, "register", "ptr", "length"),
    _a(TRANSFER_ENGINE, "engine"),
    _m(_SENDER, "__init__", "mgr", "bootstrap_addr", "bootstrap_room"),
    _a(_SENDER, "supports_host_tensor_indices"),
    _m(_SENDER, "init", "num_kv_indices", "aux_index"),
    _m(_SENDER, "poll"),
    _m(_SENDER, "clear"),
    _a(_SENDER, "kv_mgr"),
    _a(_SENDER, "bootstrap_room"),
    _m(_RECEIVER, "send_metadata", "kv_indices", "aux_index", "state_indices"),
    _m(_RECEIVER, "poll"),
    _m(_RECEIVER, "abort"),
    _m(_RECEIVER, "clear"),
    _m(_RECEIVER, "ensure_abort_notified", "force_arm"),
    _m(_RECEIVER, "failure_exception"),
    _a(_RECEIVER, "_owns_bootstrap_room"),
    _a(_RECEIVER, "abort_notified"),
    _a(_RECEIVER, "kv_mgr"),
    _a(_RECEIVER, "bootstrap_room"),
    _a(_RECEIVER, "bootstrap_addr"),
    _a(_RECEIVER, "conclude_state"),
    _a(_RECEIVER, "prefill_info"),
    _a(f"{COMMON_CONN}.PrefillServerInfo", "attn_tp_size"),
    _a(f"{COMMON_CONN}.CommonKVManager", "attn_tp_size"),
    Relied("sglang.srt.disaggregation.utils", "all_reduce_flags", "function"),
    # The queues Lynx hooks, and what it reads off them.
    _m("sglang.srt.disaggregation.prefill.PrefillBootstrapQueue", "_init_kv_manager"),
    _a("sglang.srt.disaggregation.prefill.PrefillBootstrapQueue", "token_to_kv_pool"),
    _m("sglang.srt.disaggregation.decode.DecodePreallocQueue", "_init_kv_manager"),
    _a("sglang.srt.disaggregation.decode.DecodePreallocQueue", "token_to_kv_pool"),
    _a("sglang.srt.disaggregation.decode.DecodePreallocQueue", "scheduler"),
    _a("sglang.srt.managers.tp_worker.TpModelWorker", "random_seed"),
    _m("sglang.srt.disaggregation.decode.DecodeTransferQueue", "_commit_transfer_to_req", "decode_req"),
    _a("sglang.srt.disaggregation.decode.DecodeTransferQueue", "scheduler"),
    _a("sglang.srt.disaggregation.decode.DecodeRequest", "req"),
    _a("sglang.srt.disaggregation.decode.DecodeRequest", "kv_receiver"),
    # KV pool.
    _a("sglang.srt.mem_cache.memory_pool.MHATokenToKVPool", "k_buffer"),
    _a("sglang.srt.mem_cache.memory_pool.MHATokenToKVPool", "v_buffer"),
    _a("sglang.srt.mem_cache.memory_pool.KVCache", "dtype"),
    _a("sglang.srt.mem_cache.memory_pool.KVCache", "store_dtype"),
    # Requests: what Lynx reads, and the fields it writes through this module.
    _a(_REQ, "rid"),
    _a(_REQ, "origin_input_ids"),
    _a(_REQ, "output_ids"),
    _a(_REQ, "sampling_params"),
    _a(_REQ, "return_logprob"),
    _a(_REQ, "logprob"),
    *(_a(f"{SCHEDULE_BATCH}.ReqLogprob", name) for name in ("top_logprobs_num", "token_ids_logprob")),
    *(_a(f"{SCHEDULE_BATCH}.ReqLogprob", name) for name in _OUTPUT_LOGPROB_FIELDS),
    Relied("sglang.srt.layers.sampler", "SGLANG_RETURN_ORIGINAL_LOGPROB", "member"),
    _a(_REQ, "grammar"),
    _a(_REQ, "custom_logit_processor"),
    _a(_REQ, "return_hidden_states"),
    _a(_REQ, "return_sampling_mask"),
    _a(_REQ, "return_routed_experts"),
    _a(_REQ, "return_indexer_topk"),
    *(_a(_REQ, name) for name in _REASONING_FIELDS),
    _a(_SCHEDULER, "batch_result_processor"),
    _m(_SCHEDULER, "pause_generation", "recv_req"),
    _a("sglang.srt.managers.io_struct.PauseGenerationReqInput", "mode"),
    _m(
        "sglang.srt.managers.scheduler_components.batch_result_processor.SchedulerBatchResultProcessor",
        "_maybe_update_reasoning_tokens",
        "req",
        "next_token_id",
    ),
    _a(_REQ, "to_finish"),
    _a(_REQ, "finished_reason"),
    _a(_REQ, "finished_len"),
    _a(_REQ, "customized_info"),
    _a(_REQ, "kv"),
    _m(_REQ, "finished"),
    _m(_REQ, "update_finish_state", "new_accepted_len"),
    _a(f"{SCHEDULE_BATCH}.ReqKvInfo", "req_pool_idx"),
    _a(f"{SCHEDULE_BATCH}.ReqKvInfo", "kv_committed_len"),
    _a(f"{SCHEDULE_BATCH}.ReqKvInfo", "kv_allocated_len"),
    Relied(SCHEDULE_BATCH, "FINISH_ABORT", "class"),
    _a("sglang.srt.sampling.sampling_params.SamplingParams", "temperature"),
    _a("sglang.srt.sampling.sampling_params.SamplingParams", "top_k"),
    _a("sglang.srt.sampling.sampling_params.SamplingParams", "top_p"),
    _a("sglang.srt.sampling.sampling_params.SamplingParams", "min_p"),
    _a("sglang.srt.sampling.sampling_params.SamplingParams", "frequency_penalty"),
    _a("sglang.srt.sampling.sampling_params.SamplingParams", "presence_penalty"),
    _a("sglang.srt.sampling.sampling_params.SamplingParams", "repetition_penalty"),
    _a("sglang.srt.sampling.sampling_params.SamplingParams", "min_new_tokens"),
    _a("sglang.srt.sampling.sampling_params.SamplingParams", "logit_bias"),
    _a("sglang.srt.sampling.sampling_params.SamplingParams", "watermark"),
    # Batches and the scheduler.
    _m(
        _BATCH,
        "init_new",
        "reqs",
        "req_to_token_pool",
        "token_to_kv_pool_allocator",
        "tree_cache",
        "model_config",
        "enable_overlap",
        "spec_algorithm",
    ),
    _m(_BATCH, "filter_batch", "keep_indices"),
    _m(_BATCH, "is_empty"),
    _m(_BATCH, "retract_decode"),
    *(
        _a(_BATCH, name)
        for name in (
            "reqs",
            "forward_mode",
            "seq_lens",
            "seq_lens_cpu",
            "orig_seq_lens",
            "seq_lens_sum",
            "req_pool_indices",
            "req_pool_indices_cpu",
            "out_cache_loc",
            "input_ids",
            "multimodal_inputs",
            "sampling_info",
        )
    ),
    _m(
        "sglang.srt.sampling.sampling_batch_info.SamplingBatchInfo",
        "from_schedule_batch",
        "batch",
        "vocab_size",
    ),
    Relied("sglang.srt.model_executor.forward_batch_info.ForwardMode", "DECODE", "member"),
    _m("sglang.srt.model_executor.forward_batch_info.ForwardMode", "is_decode"),
    _a("sglang.srt.managers.utils.GenerationBatchResult", "logits_output"),
    _a("sglang.srt.layers.logits_processor.LogitsProcessorOutput", "next_token_logits"),
    _a("sglang.srt.mem_cache.memory_pool.ReqToTokenPool", "device"),
    _a("sglang.srt.mem_cache.memory_pool.ReqToTokenPool", "req_to_token"),
    _m("sglang.srt.mem_cache.allocator.base.BaseTokenToKVPoolAllocator", "available_size"),
    _m("sglang.srt.mem_cache.base_prefix_cache.BasePrefixCache", "free_kv_row", "kv", "ranges"),
    _a("sglang.srt.configs.model_config.ModelConfig", "vocab_size"),
    _m("sglang.srt.managers.tp_worker.TpModelWorker", "forward_batch_generation", "batch", "is_verify"),
    _m(_SCHEDULER, "is_fully_idle"),
    _m(_SCHEDULER, "process_batch_result", "batch", "result"),
    _m(_SCHEDULER, "collect_inflight_reqs"),
    *(
        _a(_SCHEDULER, name)
        for name in (
            "running_batch",
            "waiting_queue",
            "tree_cache",
            "req_to_token_pool",
            "token_to_kv_pool_allocator",
            "model_config",
            "spec_algorithm",
            "tp_worker",
            "output_streamer",
            "disagg_prefill_bootstrap_queue",
            "disagg_decode_prealloc_queue",
            "enable_overlap",
            "attn_tp_cpu_group",
            "last_batch",
            "result_queue",
        )
    ),
    *(
        _a("sglang.srt.server_args.ServerArgs", name)
        for name in (
            "disaggregation_mode",
            "disaggregation_transfer_backend",
            "disaggregation_decode_retraction_backup",
            "disable_overlap_schedule",
            "tp_size",
            "attn_dp_size",
            "host",
            "enable_metrics",
            "speculative_algorithm",
            "disaggregation_decode_enable_radix_cache",
            "disaggregation_enable_kv_checksum",
        )
    ),
    Relied("sglang.srt.mem_cache.common", "release_kv_cache", "function"),
    _m(
        "sglang.srt.managers.scheduler_components.new_token_ratio_tracker.NewTokenRatioTracker",
        "estimate_new_token_ratio_after_retract",
    ),
    _m(
        "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer",
        "stream_output",
        "reqs",
        "return_logprob",
    ),
    _m(
        "sglang.srt.managers.scheduler_components.output_streamer.SchedulerOutputStreamer",
        "is_request_level_customized_info_key",
        "key",
    ),
    _m(_ACCUMULATOR, "accept", "req"),
    *(_a(_ACCUMULATOR, name) for name in ("output_reqs", "customized_info")),
    *(_a(_REQ, name) for name in ("send_token_offset", "stream", "customized_info")),
    _a(
        "sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController",
        "scheduler",
    ),
    _a("sglang.srt.managers.io_struct.GetInternalStateReqOutput", "internal_state"),
    # The tokenizer's parallel samples: each gets its own room (lynx_patches.tokenizer_manager).
    _m(_TOKENIZER_MANAGER, "_handle_batch_request", "obj", "request", "request_states"),
    _m(_TOKENIZER_MANAGER, "_send_one_request", "tokenized_obj"),
    *(_a(_GENERATE_INPUT, name) for name in ("parallel_sample_num", "bootstrap_room", "batch_size")),
    *(_a(_TOKENIZED_INPUT, name) for name in ("bootstrap_room", "bootstrap_host")),
    Relied("sglang.srt.disaggregation.utils", "FAKE_BOOTSTRAP_HOST", "member"),
    # The CPU attention backend's per-row decode attention, wrapped for verify passes.
    _m(
        "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend",
        "_run_sdpa_forward_decode",
        "query",
        "output",
        "k_cache",
        "v_cache",
        "req_to_token",
        "req_pool_indices",
        "seq_lens",
        "encoder_lens",
        "scaling",
        "enable_gqa",
        "causal",
        "is_cross_attn",
        "sliding_window_size",
    ),
)


# ---- Mooncake connector ---------------------------------------------------------------------


@dataclass(frozen=True)
class MetadataFrames:
    """Decode's per-request metadata message to prefill, as far as Lynx reads it.

    Upstream's layout (``MooncakeKVManager.build_receiver_metadata_message``): frame 0 the
    room (ASCII digits), 1 decode's host, 2 its port, 3 its Mooncake session id, 4 and 5
    its KV page ids and aux index, both empty for a dummy rank (nothing is sent to it).
    """

    room: int
    endpoint: tuple[str, int]
    session: str
    is_dummy: bool


def parse_metadata_frames(frames: Sequence[bytes]) -> MetadataFrames | None:
    """The request fields of a metadata message; None for any other message (e.g. the
    per-rank registration, whose frame 0 is not a room) and for one whose fields are not
    ASCII numbers and names (a peer's garbage: read on upstream's bootstrap thread, which
    an exception would end)."""
    if len(frames) < 6 or not frames[0].isdigit() or not frames[2].isdigit():
        return None
    try:
        host, session = frames[1].decode("ascii"), frames[3].decode("ascii")
    except UnicodeDecodeError:
        return None
    return MetadataFrames(
        room=int(frames[0]),
        endpoint=(host, int(frames[2])),
        session=session,
        is_dummy=frames[4] == b"" and frames[5] == b"",
    )


# Messages that upstream's control threads parse and act on in one step, so they cannot be
# parsed ahead, by the side that receives them: the frames each handler reads as ASCII
# integers, those it reads as ASCII text, and its frame count (``common.staging_handler``;
# ``MooncakeKVManager._handle_aux_data``, which also unpacks frame 4 as a big-endian u32).
_READ_BY_HANDLER = {
    True: {  # prefill
        b"WATERMARK": ((1, 2), (3,), 3),
        b"STAGING_RSP": ((1, 2, 3, 4, 5), (6,), 7),
    },
    False: {  # decode
        b"STAGING_REQ": ((1,), (4,), 5),
        b"AUX_DATA": ((1, 2, 3), (), 6),
    },
}


def unreadable_peer_message(manager: Any, frames: Sequence[bytes]) -> str | None:
    """Why upstream's thread on this server's control socket would raise on a peer's
    message ``frames``; None if it reads it.

    That thread (``MooncakeKVManager.start_prefill_thread`` / ``start_decode_thread``) has
    no guard: one exception ends it for good, and the server, still healthy to the router,
    then takes no new request (prefill) or no transfer status (decode). Lynx's receive hook
    asks this first and drops what upstream could not read. Where upstream's parser has no
    side effect it is run here (``TransferInfo`` / ``KVArgsRegisterInfo.from_zmq``); the
    messages of ``_READ_BY_HANDLER`` are read as their handlers read them; the rest (abort
    notifications and acks, status, ``CHUNK_READY``) upstream reads with guards of its own.
    """
    from sglang.srt.disaggregation.common.conn import ABORT_TAG
    from sglang.srt.disaggregation.mooncake.conn import KVArgsRegisterInfo, TransferInfo

    if not frames:
        return "an empty message"
    prefill = manager_is_prefill(manager)
    head = frames[0]
    handled = _READ_BY_HANDLER[prefill].get(head)
    if handled is not None:
        integers, texts, count = handled
        name = head.decode()
        if len(frames) < count:
            return f"{name} with {len(frames)} frames, not {count}"
        digits = all(frames[i].isdigit() for i in integers)
        if not digits or not all(frames[i].isascii() for i in texts if i < len(frames)):
            return f"{name} with fields that are not ASCII"
        if head == b"AUX_DATA":
            return None if len(frames[4]) == 4 else "AUX_DATA whose length is not 4 bytes"
        staging_off = manager._staging_ctx is None
        return f"{name} while upstream's staging buffers are off" if staging_off else None
    if not prefill or head == ABORT_TAG:
        return None  # read by upstream with a guard
    try:  # upstream's own parsers: any exception is one that would end its thread
        (KVArgsRegisterInfo if head == b"None" else TransferInfo).from_zmq(list(frames))
    except Exception as exc:  # whatever they raise, the thread would die of it
        return f"a message upstream cannot parse ({type(exc).__name__}: {exc})"
    return None


def aborted_room(msg: Sequence[bytes]) -> int | None:
    """The room of decode's abort notification, or None if ``msg`` is not one."""
    from sglang.srt.disaggregation.common.conn import ABORT_TAG, AbortNotification

    if not msg or msg[0] != ABORT_TAG:
        return None
    notification = AbortNotification.from_zmq(list(msg))
    return None if notification is None else int(notification.room)


def upstream_status(status: int) -> Upstream:
    """Upstream's ``KVPoll`` reduced to what Lynx's receive state needs."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    if status == KVPoll.Success:
        return Upstream.SUCCESS
    if status == KVPoll.Failed:
        return Upstream.FAILED
    return Upstream.PENDING


def room_is_live(manager: Any, room: int) -> bool:
    """Prefill: the request is known, not failed, and has a real (non-dummy) decode rank."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    return (
        room in manager.request_status
        and manager.check_status(room) != KVPoll.Failed
        and any(not info.is_dummy for info in manager.transfer_infos.get(room, {}).values())
    )


def room_failed(manager: Any, room: int) -> bool:
    from sglang.srt.disaggregation.base.conn import KVPoll

    return manager.request_status.get(room) == KVPoll.Failed


def fail_room(manager: Any, room: int, reason: str) -> None:
    """Fail the request on this side; upstream tells the peer (with the reason)."""
    manager.conclude_failure(bootstrap_room=room, failure_reason=reason)


def fail_receiver(receiver: Any, reason: str) -> None:
    """Decode: fail the receiver's request now, with ``reason`` for the client."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    receiver.kv_mgr.record_failure(receiver.bootstrap_room, reason)
    receiver.kv_mgr.update_status(receiver.bootstrap_room, KVPoll.Failed)
    receiver.conclude_state = KVPoll.Failed


def fail_receiver_alone(receiver: Any) -> None:
    """Decode: fail the receiver's request without touching its room's state, which is
    another request's (status, failure record, prefill's side): the receiver gives the
    room up as upstream's own duplicate-room check does (``CommonKVReceiver.__init__``),
    and never sends prefill an abort for it. Its reason comes from
    :func:`receiver_failure` in the receiver's ``failure_exception``."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    receiver._owns_bootstrap_room = False
    receiver.abort_notified = True
    receiver.conclude_state = KVPoll.Failed


def receiver_failure(receiver: Any, reason: str) -> Exception:
    """What a failed receiver's ``failure_exception`` raises: the request fails with ``reason``."""
    from sglang.srt.disaggregation.common.conn import KVTransferError

    return KVTransferError(receiver.bootstrap_room, reason)


def send_to_peer(manager: Any, endpoint: tuple[str, int], frames: list[bytes]) -> None:
    """Send ``frames`` on upstream's ZMQ socket to a peer's control endpoint."""
    from sglang.srt.utils.network import NetworkAddress

    address = NetworkAddress(*endpoint)
    manager._send_multipart_locked(address.to_tcp(), frames, is_ipv6=address.is_ipv6)


def manager_transfer_engine(manager: Any) -> tuple[Any, str]:
    """(the Mooncake ``TransferEngine``, this server's session id)."""
    return manager.engine.engine, manager.engine.get_session_id()


def control_endpoint(manager: Any) -> str:
    """The ZMQ endpoint where the manager receives its peers' messages."""
    return f"tcp://{manager.local_ip}:{manager.rank_port}"


def register_receive_buffer(manager: Any, address: int, nbytes: int) -> None:
    manager.engine.register(address, nbytes)


def manager_page_size(manager: Any) -> int:
    return int(manager.kv_args.page_size)


def manager_engine_rank(manager: Any) -> int:
    return int(manager.kv_args.engine_rank)


def manager_attn_tp_size(manager: Any) -> int:
    """How many attention-TP ranks this server's KV heads are split over."""
    return int(manager.attn_tp_size)


def queue_scheduler(queue: Any) -> Any:
    return queue.scheduler


def controller_scheduler(controller: Any) -> Any:
    """The scheduler whose ``/server_info`` internal state ``controller`` answers with."""
    return controller.scheduler


def random_seed(scheduler: Any) -> int:
    """The scheduler's random seed: its model worker broadcasts one seed to every TP rank,
    which upstream's sampler relies on."""
    return int(scheduler.tp_worker.random_seed)


def peer_attn_tp_size(receiver: Any) -> int | None:
    """Decode, after ``init``: the attention-TP size of the receiver's prefill server (None
    if upstream never learnt it: its request has failed already)."""
    info = getattr(receiver, "prefill_info", None)
    return None if info is None else int(info.attn_tp_size)


def rank_reduce_min(scheduler: Any) -> Callable[[list[int]], list[int]]:
    """Elementwise MIN over the scheduler's attention-TP ranks (gloo, as upstream reduces
    its transfer polls); the identity on one rank."""
    import torch.distributed as dist
    from sglang.srt.disaggregation.utils import all_reduce_flags

    group = scheduler.attn_tp_cpu_group
    return lambda flags: all_reduce_flags(flags, group, dist.ReduceOp.MIN)


def manager_is_prefill(manager: Any) -> bool:
    from sglang.srt.disaggregation.utils import DisaggregationMode

    return manager.disaggregation_mode == DisaggregationMode.PREFILL


def manager_is_mla(manager: Any) -> bool:
    return bool(manager.is_mla_backend)


def metrics_enabled(manager: Any) -> bool:
    return bool(getattr(manager.server_args, "enable_metrics", False))


def synchronize_send_events(kwargs: dict[str, Any]) -> None:
    """Prefill's send path may pass CUDA events that order the page-index copy; Lynx
    encodes on the scheduler thread, so it waits for them here (and upstream gets none)."""
    for name in ("wait_event", "indices_event"):
        event = kwargs.pop(name, None)
        if event is not None:
            event.synchronize()


def metadata_state_indices(args: Sequence[Any], kwargs: dict[str, Any]) -> Any:
    """``state_indices`` of ``MooncakeKVReceiver.send_metadata(kv_indices, aux_index, state_indices)``."""
    return args[1] if len(args) > 1 else kwargs.get("state_indices")


# ---- KV pool and queues ---------------------------------------------------------------------


def queue_kv_pool(queue: Any) -> Any:
    return queue.token_to_kv_pool


def kv_pool_buffers(pool: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The per-layer K and V buffers of an MHA KV pool; raises (naming the pool) for any
    other kind, and for a quantized KV cache."""
    k, v = getattr(pool, "k_buffer", None), getattr(pool, "v_buffer", None)
    if not isinstance(k, list) or not isinstance(v, list):
        raise LynxConfigError(f"--lynx needs an MHA KV pool with per-layer K/V buffers, got {type(pool)}")
    if getattr(pool, "store_dtype", pool.dtype) != pool.dtype:
        raise LynxConfigError(f"--lynx does not support a quantized KV cache ({pool.dtype})")
    return k, v


def free_kv_tokens(scheduler: Any) -> int:
    return int(scheduler.token_to_kv_pool_allocator.available_size())


def vocab_size(scheduler: Any) -> int:
    return int(scheduler.model_config.vocab_size)


# ---- requests ---------------------------------------------------------------------------------


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


def returns_original_logprobs() -> bool:
    """Upstream's sampler returns logprobs before temperature scaling
    (``SGLANG_RETURN_ORIGINAL_LOGPROB``)."""
    from sglang.srt.layers import sampler

    return bool(sampler.SGLANG_RETURN_ORIGINAL_LOGPROB)


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


def reasoning_state(req: Any) -> tuple[Any, ...]:
    return tuple(getattr(req, name) for name in _REASONING_FIELDS)


def recount_reasoning(scheduler: Any, req: Any, state: tuple[Any, ...], tokens: Sequence[int]) -> None:
    """Restore the reasoning count to ``state`` and count ``tokens`` on top, as upstream
    counts decoded tokens."""
    for name, value in zip(_REASONING_FIELDS, state, strict=True):
        setattr(req, name, value)
    if tokens:
        scheduler.batch_result_processor._maybe_update_reasoning_tokens(req, list(tokens))


def set_request_info(req: Any, key: str, value: dict[str, Any]) -> None:
    """Put ``value`` into the response's ``meta_info[key]`` (upstream's request-level
    customized info: one entry per request)."""
    if req.customized_info is None:
        req.customized_info = {}
    req.customized_info[key] = [value]


def first_stream_chunk(req: Any) -> bool:
    """No token of ``req`` has been streamed yet (its next output is its first chunk)."""
    return req.send_token_offset == 0


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


def tokenized_room(tokenized_obj: Any) -> int | None:
    """The bootstrap room a tokenized request is about to be sent to the scheduler with."""
    return getattr(tokenized_obj, "bootstrap_room", None)


def send_with_room(tokenized_obj: Any, room: int) -> None:
    tokenized_obj.bootstrap_room = room


def send_without_transfer(tokenized_obj: Any) -> None:
    """Run the request on upstream's fake transfer (as its server warm-up does): prefill
    sends nothing, decode waits for nothing and decodes on whatever its pages hold."""
    from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST

    tokenized_obj.bootstrap_host = FAKE_BOOTSTRAP_HOST


def is_aborting(req: Any) -> bool:
    """An abort (client or server) is pending on the request."""
    return req.to_finish is not None


def abort_with(req: Any, reason: str) -> None:
    """Finish the request at its next finish check with ``reason`` (HTTP 500)."""
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    req.to_finish = FINISH_ABORT(reason, HTTPStatus.INTERNAL_SERVER_ERROR)


def clear_finish(req: Any) -> None:
    """Undo a finish upstream's check just set (it is deferred until verification)."""
    req.finished_reason = None
    req.finished_len = None


def truncate_output(req: Any, keep: int) -> None:
    """Keep the first ``keep`` output tokens."""
    del req.output_ids[keep:]


def append_output(req: Any, token: int) -> None:
    req.output_ids.append(token)


def kv_allocated_len(req: Any) -> int:
    return int(req.kv.kv_allocated_len)


def req_pool_row(req: Any) -> int:
    return int(req.kv.req_pool_idx)


def set_kv_len(scheduler: Any, req: Any, kept: int, free: tuple[int, int] | None) -> None:
    """The request's KV now ends at ``kept`` tokens; ``free`` ([start, end), page-aligned) goes back to
    the pool."""
    if free is not None:
        scheduler.tree_cache.free_kv_row(req.kv, [free])
    req.kv.kv_committed_len = req.kv.kv_allocated_len = kept


# ---- the scheduler's queues ----------------------------------------------------------------


def remove_from_batches(scheduler: Any, reqs: Iterable[Any]) -> None:
    """Take ``reqs`` out of the running batch and the waiting queue (they keep their KV)."""
    ids = {id(req) for req in reqs}
    batch = scheduler.running_batch
    if any(id(req) in ids for req in batch.reqs):
        batch.filter_batch(keep_indices=[i for i, req in enumerate(batch.reqs) if id(req) not in ids])
    if any(id(req) in ids for req in scheduler.waiting_queue):
        scheduler.waiting_queue = [req for req in scheduler.waiting_queue if id(req) not in ids]


def overlaps(scheduler: Any) -> bool:
    """The scheduler runs upstream's overlap loop (a batch in flight while the last one's
    results are processed)."""
    return bool(scheduler.enable_overlap)


def process_in_flight_batch(scheduler: Any) -> None:
    """Overlap loop: process the results of the batch launched last iteration now, so no
    request has a token in flight, and leave the loop no last batch to process -- what
    upstream's own ``pause_generation`` does before it retracts. A no-op otherwise."""
    if scheduler.enable_overlap and scheduler.last_batch is not None and scheduler.result_queue:
        batch, result = scheduler.result_queue.popleft()
        scheduler.process_batch_result(batch, result)
        scheduler.last_batch = None


def pause_retracts(recv_req: Any) -> bool:
    """A ``pause_generation`` request that retracts running requests (not in place)."""
    return recv_req.mode == "retract"


def requeue(scheduler: Any, req: Any) -> None:
    """Back through the waiting queue: upstream's prebuilt path re-admits it with its
    committed tokens, as it resumes a retracted request."""
    scheduler.waiting_queue.append(req)


def release_and_answer(scheduler: Any, req: Any) -> None:
    """A finished request: free its KV and answer the client (upstream's prebuilt path
    refuses finished requests)."""
    from sglang.srt.mem_cache.common import release_kv_cache

    release_kv_cache(req, scheduler.tree_cache, checkpoint=True)
    scheduler.output_streamer.stream_output([req], req.return_logprob)


def batch_without(batch: Any, remove: Sequence[int]) -> None:
    """Drop rows ``remove`` of ``batch`` (their requests keep their KV)."""
    gone = set(remove)
    batch.filter_batch(keep_indices=[i for i in range(len(batch.reqs)) if i not in gone])


def nothing_retracted(parked: list[Any]) -> tuple[list[Any], float, list[Any]]:
    """``retract_decode``'s result when Lynx parked every request of the batch instead."""
    from sglang.srt.managers.scheduler_components.new_token_ratio_tracker import NewTokenRatioTracker

    return [], NewTokenRatioTracker.estimate_new_token_ratio_after_retract(parked), []


# ---- the verify forward ----------------------------------------------------------------------


def decode_forward_rows(forward_batch: Any, n_rows: int) -> list[int] | None:
    """The request-pool rows of a decode forward's first ``n_rows`` rows; None if it is
    not a decode forward."""
    if not forward_batch.forward_mode.is_decode():
        return None
    return forward_batch.req_pool_indices[:n_rows].tolist()


def next_token_logits(logits_output: Any) -> torch.Tensor:
    return logits_output.next_token_logits


def run_verify_forward(
    scheduler: Any, reqs: Sequence[Any], prompt_lens: Sequence[int], *, in_steps: bool
) -> list[torch.Tensor]:
    """Verify the held tokens of ``reqs`` on the decode path and return each request's
    (k, vocab) float32 CPU logits, k = its output length - 1.

    Row i of a request feeds ``t_i`` at position ``prompt_len + i`` into its KV slot there
    and attends to the request's KV up to and including that slot: what decode step i
    computed on the Anchor, now over the refined prompt.

    ``in_steps`` (``--lynx-verify-pass steps``): row i of every request runs in decode
    forward i, one row per request, so each row is computed by the very kernels, shapes
    and reduction orders of the decode step that would have produced it without
    speculation: its logits and the KV it writes are that step's, bit for bit, whatever
    the kernels (one decode step per held token). Otherwise (``batched``) every row of
    every request runs in ONE decode forward: the linear layers see all rows at once and,
    on the CPU backend, a request's rows attend in one masked call
    (:mod:`lynx_patches.torch_native_backend`); a few decode steps' cost, equal to the
    decode path up to the kernels' rounding (exact where they are batch-invariant).
    """
    held = []
    for req, prompt_len in zip(reqs, prompt_lens, strict=True):
        k = len(req.output_ids) - 1
        if k < 1 or kv_allocated_len(req) != prompt_len + k:
            raise RuntimeError(
                f"request {req.rid}: {kv_allocated_len(req)} KV slots for a prompt of "
                f"{prompt_len} and {k} held tokens"
            )
        held.append(k)
    rows = [
        (req, prompt_len, i)
        for req, prompt_len, k in zip(reqs, prompt_lens, held, strict=True)
        for i in range(k)
    ]
    if not in_steps:
        return list(_decode_forward(scheduler, rows).split(held))
    per_req: list[list[torch.Tensor]] = [[] for _ in reqs]
    for step in range(max(held)):
        live = [n for n, k in enumerate(held) if k > step]
        logits = _decode_forward(scheduler, [(reqs[n], prompt_lens[n], step) for n in live])
        for n, row in zip(live, logits, strict=True):
            per_req[n].append(row)
    return [torch.stack(rows_of_req) for rows_of_req in per_req]


def _decode_forward(scheduler: Any, rows: Sequence[tuple[Any, int, int]]) -> torch.Tensor:
    """One DECODE forward over ``rows`` (request, prompt length, held position i): row i
    of a request feeds ``output_ids[i]`` into the KV slot at ``prompt_len + i`` and
    attends up to it. Every layer writes the KV of all rows before any row attends.
    Returns the (rows, vocab) float32 CPU logits, one per row, in order."""
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

    device = scheduler.req_to_token_pool.device
    table = scheduler.req_to_token_pool.req_to_token
    row_reqs = [req for req, _, _ in rows]
    pool_rows = [req_pool_row(req) for req in row_reqs]
    seq_lens = [prompt_len + i + 1 for _, prompt_len, i in rows]
    batch = ScheduleBatch.init_new(
        row_reqs,
        scheduler.req_to_token_pool,
        scheduler.token_to_kv_pool_allocator,
        scheduler.tree_cache,
        scheduler.model_config,
        False,
        scheduler.spec_algorithm,
    )
    batch.forward_mode = ForwardMode.DECODE
    batch.seq_lens = torch.tensor(seq_lens, dtype=torch.int64, device=device)
    batch.seq_lens_cpu = torch.tensor(seq_lens, dtype=torch.int64)
    batch.orig_seq_lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    batch.seq_lens_sum = sum(seq_lens)
    batch.req_pool_indices = torch.tensor(pool_rows, dtype=torch.int64, device=device)
    batch.req_pool_indices_cpu = torch.tensor(pool_rows, dtype=torch.int64)
    slots = torch.stack([table[row, seq_len - 1] for row, seq_len in zip(pool_rows, seq_lens, strict=True)])
    batch.out_cache_loc = slots.to(device=device, dtype=torch.int64)
    batch.input_ids = torch.tensor(
        [req.output_ids[i] for req, _, i in rows], dtype=torch.int64, device=device
    )
    batch.multimodal_inputs = [None] * len(rows)
    batch.sampling_info = SamplingBatchInfo.from_schedule_batch(batch, vocab_size(scheduler))
    result = scheduler.tp_worker.forward_batch_generation(batch, is_verify=True)
    logits = next_token_logits(result.logits_output)
    if logits.shape[0] != len(rows):
        raise RuntimeError(f"verify forward gave {logits.shape[0]} logit rows for {len(rows)}")
    return logits.float().cpu()


# ---- the contract, checked ------------------------------------------------------------------


def _resolve(dotted: str) -> Any:
    """The module, class or member at ``dotted`` (a module path, then attributes)."""
    import importlib

    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(f"no module in {dotted}")


def _instance_attributes(cls: type) -> set[str]:
    """Names assigned as ``self.<name>`` in the source of ``cls`` and its bases, and the
    class-level (annotated or assigned) names."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass is not object:
            names |= _own_attributes(klass)
    return names


@functools.cache
def _own_attributes(klass: type) -> frozenset[str]:
    """What :func:`_instance_attributes` finds in ``klass`` itself. Cached: the contract
    names ~20 classes in ~130 entries, and parsing a class's source (the scheduler's is
    thousands of lines) is nearly all the check's time."""
    import ast
    import inspect
    import textwrap

    names = set(vars(klass)) | set(getattr(klass, "__annotations__", {}))
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
    except (OSError, TypeError, SyntaxError):
        return frozenset(names)
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets = [node.target]
        for target in targets:
            for sub in ast.walk(target):
                if (
                    isinstance(sub, ast.Attribute)
                    and isinstance(sub.value, ast.Name)
                    and sub.value.id == "self"
                ):
                    names.add(sub.attr)
    return frozenset(names)


def contract_violations(contract: Iterable[Relied] = CONTRACT) -> list[str]:
    """Each relied-upon name the installed SGLang no longer has, as a sentence naming it."""
    import inspect

    problems = []
    for relied in contract:
        where = f"{relied.owner}.{relied.name}"
        try:
            owner = _resolve(relied.owner)
        except (ImportError, AttributeError) as exc:
            problems.append(f"{relied.owner}: cannot import ({exc})")
            continue
        if relied.kind == "attribute":
            if not isinstance(owner, type) or relied.name not in _instance_attributes(owner):
                problems.append(f"{where}: no such attribute is set on instances")
            continue
        if not hasattr(owner, relied.name):
            problems.append(f"{where}: missing")
            continue
        if relied.kind == "method":
            try:
                params = inspect.signature(getattr(owner, relied.name)).parameters
            except (TypeError, ValueError):
                continue
            missing = [p for p in relied.params if p not in params]
            if missing:
                problems.append(f"{where}: parameters {missing} missing (has {list(params)})")
    return problems


def metadata_frames_violation() -> str | None:
    """Whether upstream's metadata message still has the layout
    :func:`parse_metadata_frames` reads (built by upstream's own method)."""
    from types import SimpleNamespace

    import numpy as np
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager

    fake = SimpleNamespace(local_ip="10.1.2.3", rank_port=4567, get_session_id=lambda: "10.1.2.3:9999")
    build = MooncakeKVManager.build_receiver_metadata_message
    fields = {"required_dst_info_num": 1, "state_indices": None, "decode_prefix_len": 0}
    real = build(
        fake, bootstrap_room=42, kv_indices=np.array([1, 2], np.int32), aux_index=3, is_dummy=False, **fields
    )
    dummy = build(
        fake, bootstrap_room=43, kv_indices=np.array([], np.int32), aux_index=None, is_dummy=True, **fields
    )
    want = (
        MetadataFrames(42, ("10.1.2.3", 4567), "10.1.2.3:9999", False),
        MetadataFrames(43, ("10.1.2.3", 4567), "10.1.2.3:9999", True),
    )
    got = (parse_metadata_frames(real), parse_metadata_frames(dummy))
    return (
        None if got == want else f"metadata frames parse as {got}, expected {want} (frames {real}, {dummy})"
    )


if __name__ == "__main__":  # python -m lynx_patches.upstream: check the installed SGLang
    import sys

    from lynx_patches import sgl_kernel
    from lynx_patches._hooks import is_cpu_engine

    if is_cpu_engine():
        sgl_kernel.install()
    found = contract_violations()
    frames = metadata_frames_violation()
    for line in [*found, *([frames] if frames else [])]:
        print(line)
    sys.exit(1 if found or frames else 0)
