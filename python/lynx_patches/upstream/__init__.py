"""The one boundary between Lynx and SGLang's internals (``sglang==0.5.23``).

Every private attribute, message frame position, batch construction and field write
Lynx relies on is a named function of this package, one module per topic
(:mod:`~lynx_patches.upstream.connector`, :mod:`~lynx_patches.upstream.requests`,
:mod:`~lynx_patches.upstream.scheduler`, :mod:`~lynx_patches.upstream.verify_forward`);
the rest of ``lynx_patches`` calls them as ``upstream.<name>`` and reads only the public
request and batch fields the contract lists. Each accessor declares on itself the
upstream names it touches (``@relies``), each topic module in its ``RELIED`` the methods
Lynx's hooks wrap or its subclasses override and the fields hook modules read;
:data:`CONTRACT` is the union of all of them with the launcher-level names of
:mod:`~lynx_patches.upstream.contract`.
``test/plugin/test_upstream_contract.py`` checks every entry (and the metadata frame
layout) against the installed SGLang, so an upgrade that moves one fails a test naming it
instead of a request at run time; ``test/unit/test_boundary_contract.py`` reads the
glue's source and fails on any upstream attribute, method, keyword or positional
argument used and not declared.

SGLang is imported inside the functions: this package is imported at plugin
registration, before SGLang may be.
"""

from __future__ import annotations

from lynx_patches.upstream import connector, contract, first_token, requests, scheduler, verify_forward
from lynx_patches.upstream.connector import (
    MetadataFrames,
    aborted_room,
    control_endpoint,
    fail_receiver,
    fail_receiver_alone,
    fail_room,
    manager_attn_tp_size,
    manager_engine_rank,
    manager_is_mla,
    manager_is_prefill,
    manager_page_size,
    manager_transfer_engine,
    metadata_frames_violation,
    metadata_state_indices,
    metrics_enabled,
    parse_metadata_frames,
    peer_attn_tp_size,
    random_seed,
    rank_reduce_min,
    receiver_failure,
    register_receive_buffer,
    room_failed,
    room_is_live,
    send_to_peer,
    synchronize_send_events,
    unreadable_peer_message,
    upstream_status,
)
from lynx_patches.upstream.contract import (
    Relied,
    contract_violations,
    declared_in,
)
from lynx_patches.upstream.first_token import (
    aux_row_landed,
    commit_first_token,
    end_commit,
    first_token_may_go_early,
    transfer_queue,
)
from lynx_patches.upstream.requests import (
    abort_with,
    append_output,
    bootstrap_room,
    clear_finish,
    first_stream_chunk,
    is_aborting,
    is_finished,
    kv_allocated_len,
    logprob_request,
    max_new_tokens,
    output_ids,
    parallel_sample_rooms,
    prompt_len,
    reasoning_state,
    recount_reasoning,
    replace_output_logprobs,
    req_pool_row,
    request_id,
    resend_request_info,
    returns_original_logprobs,
    sampling_settings,
    send_with_room,
    set_kv_len,
    set_request_info,
    streamed_every_token,
    tokenized_room,
    truncate_output,
    update_finish_state,
)
from lynx_patches.upstream.scheduler import (
    batch_without,
    chunks_to_send,
    controller_scheduler,
    decode_radix_cache,
    extended_layer,
    free_kv_tokens,
    kv_pool_buffers,
    kv_pool_start_layer,
    nothing_retracted,
    overlaps,
    pause_retracts,
    process_in_flight_batch,
    queue_kv_pool,
    queue_scheduler,
    release_and_answer,
    remove_from_batches,
    requeue,
    stream_now,
    vocab_size,
)
from lynx_patches.upstream.verify_forward import (
    LayerwiseRows,
    advance_layerwise,
    decode_forward_rows,
    layerwise_logits,
    layerwise_unsupported,
    next_token_logits,
    run_verify_forward,
)

# Every name declared once, however many accessors declare it.
CONTRACT: tuple[Relied, ...] = tuple(
    dict.fromkeys(
        [
            *contract.RELIED,
            *(
                relied
                for topic in (connector, first_token, requests, scheduler, verify_forward)
                for relied in declared_in(topic)
            ),
        ]
    )
)

__all__ = [
    "CONTRACT",
    "LayerwiseRows",
    "MetadataFrames",
    "Relied",
    "abort_with",
    "aborted_room",
    "advance_layerwise",
    "append_output",
    "aux_row_landed",
    "batch_without",
    "bootstrap_room",
    "chunks_to_send",
    "clear_finish",
    "commit_first_token",
    "contract_violations",
    "control_endpoint",
    "controller_scheduler",
    "decode_forward_rows",
    "decode_radix_cache",
    "end_commit",
    "extended_layer",
    "fail_receiver",
    "fail_receiver_alone",
    "fail_room",
    "first_stream_chunk",
    "first_token_may_go_early",
    "free_kv_tokens",
    "is_aborting",
    "is_finished",
    "kv_allocated_len",
    "kv_pool_buffers",
    "kv_pool_start_layer",
    "layerwise_logits",
    "layerwise_unsupported",
    "logprob_request",
    "manager_attn_tp_size",
    "manager_engine_rank",
    "manager_is_mla",
    "manager_is_prefill",
    "manager_page_size",
    "manager_transfer_engine",
    "max_new_tokens",
    "metadata_frames_violation",
    "metadata_state_indices",
    "metrics_enabled",
    "next_token_logits",
    "nothing_retracted",
    "output_ids",
    "overlaps",
    "parallel_sample_rooms",
    "parse_metadata_frames",
    "pause_retracts",
    "peer_attn_tp_size",
    "process_in_flight_batch",
    "prompt_len",
    "queue_kv_pool",
    "queue_scheduler",
    "random_seed",
    "rank_reduce_min",
    "reasoning_state",
    "receiver_failure",
    "recount_reasoning",
    "register_receive_buffer",
    "release_and_answer",
    "remove_from_batches",
    "replace_output_logprobs",
    "req_pool_row",
    "request_id",
    "requeue",
    "resend_request_info",
    "returns_original_logprobs",
    "room_failed",
    "room_is_live",
    "run_verify_forward",
    "sampling_settings",
    "send_to_peer",
    "send_with_room",
    "set_kv_len",
    "set_request_info",
    "stream_now",
    "streamed_every_token",
    "synchronize_send_events",
    "tokenized_room",
    "transfer_queue",
    "truncate_output",
    "unreadable_peer_message",
    "update_finish_state",
    "upstream_status",
    "vocab_size",
]
