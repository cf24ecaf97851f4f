"""The verify forward: held tokens run through the decode path's own forward."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from lynx_patches.upstream.contract import BATCH, REQ, SCHEDULER, Relied, attribute, method, relies
from lynx_patches.upstream.requests import kv_allocated_len, req_pool_row
from lynx_patches.upstream.scheduler import vocab_size

_FORWARD_BATCH_INFO = "sglang.srt.model_executor.forward_batch_info"

RELIED: tuple[Relied, ...] = (
    # What the accessors below do not declare themselves: the attention backend's
    # decode kernel Lynx's stand-in wraps.
    method(
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


@relies(
    attribute(f"{_FORWARD_BATCH_INFO}.ForwardBatch", "forward_mode"),
    attribute(f"{_FORWARD_BATCH_INFO}.ForwardBatch", "req_pool_indices"),
    method(f"{_FORWARD_BATCH_INFO}.ForwardMode", "is_decode"),
)
def decode_forward_rows(forward_batch: Any, n_rows: int) -> list[int] | None:
    """The request-pool rows of a decode forward's first ``n_rows`` rows; None if it is
    not a decode forward."""
    if not forward_batch.forward_mode.is_decode():
        return None
    return forward_batch.req_pool_indices[:n_rows].tolist()


@relies(attribute("sglang.srt.layers.logits_processor.LogitsProcessorOutput", "next_token_logits"))
def next_token_logits(logits_output: Any) -> torch.Tensor:
    return logits_output.next_token_logits


@relies(attribute(REQ, "rid"), attribute(REQ, "output_ids"))
def run_verify_forward(
    scheduler: Any,
    reqs: Sequence[Any],
    prompt_lens: Sequence[int],
    *,
    in_steps: bool,
    stop: Callable[[int, int, torch.Tensor], bool] | None = None,
) -> list[torch.Tensor]:
    """Verify the held tokens of ``reqs`` on the decode path and return each request's
    (k, vocab) float32 CPU logits, k = its output length - 1 (fewer where ``stop`` ended
    its rows).

    Row i of a request feeds ``t_i`` at position ``prompt_len + i`` into its KV slot there
    and attends to the request's KV up to and including that slot: what decode step i
    computed on the Anchor, now over the refined prompt.

    ``in_steps`` (``--lynx-verify-pass steps``): row i of every request runs in decode
    forward i, one row per request, so each row is computed by the very kernels, shapes
    and reduction orders of the decode step that would have produced it without
    speculation: its logits and the KV it writes are that step's, bit for bit, whatever
    the kernels (one decode step per held token), and ``stop(n, i, row)`` True ends request
    n's rows at row i: its later held tokens are rolled back whatever they say, so they
    cost no step. Otherwise (``batched``) every row of
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
    live = list(range(len(reqs)))
    for step in range(max(held)):
        live = [n for n in live if held[n] > step]
        if not live:
            break
        logits = _decode_forward(scheduler, [(reqs[n], prompt_lens[n], step) for n in live])
        for n, row in zip(live, logits, strict=True):
            per_req[n].append(row)
        if stop is not None:
            live = [n for n, row in zip(live, logits, strict=True) if not stop(n, step, row)]
    return [torch.stack(rows_of_req) for rows_of_req in per_req]


@relies(
    attribute(REQ, "output_ids"),
    attribute(SCHEDULER, "tree_cache"),
    attribute(SCHEDULER, "req_to_token_pool"),
    attribute(SCHEDULER, "token_to_kv_pool_allocator"),
    attribute(SCHEDULER, "model_config"),
    attribute(SCHEDULER, "spec_algorithm"),
    attribute(SCHEDULER, "tp_worker"),
    method(
        BATCH,
        "init_new",
        "reqs",
        "req_to_token_pool",
        "token_to_kv_pool_allocator",
        "tree_cache",
        "model_config",
        "enable_overlap",
        "spec_algorithm",
    ),
    attribute(BATCH, "forward_mode"),
    attribute(BATCH, "seq_lens"),
    attribute(BATCH, "seq_lens_cpu"),
    attribute(BATCH, "orig_seq_lens"),
    attribute(BATCH, "seq_lens_sum"),
    attribute(BATCH, "req_pool_indices"),
    attribute(BATCH, "req_pool_indices_cpu"),
    attribute(BATCH, "out_cache_loc"),
    attribute(BATCH, "input_ids"),
    attribute(BATCH, "multimodal_inputs"),
    attribute(BATCH, "sampling_info"),
    method(
        "sglang.srt.sampling.sampling_batch_info.SamplingBatchInfo",
        "from_schedule_batch",
        "batch",
        "vocab_size",
    ),
    Relied(f"{_FORWARD_BATCH_INFO}.ForwardMode", "DECODE", "member"),
    attribute("sglang.srt.managers.utils.GenerationBatchResult", "logits_output"),
    attribute("sglang.srt.mem_cache.memory_pool.ReqToTokenPool", "device"),
    attribute("sglang.srt.mem_cache.memory_pool.ReqToTokenPool", "req_to_token"),
    method("sglang.srt.managers.tp_worker.TpModelWorker", "forward_batch_generation", "batch", "is_verify"),
)
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
