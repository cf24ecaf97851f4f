"""The verify forward: held tokens run through the decode path's own forward."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
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
    attribute(SCHEDULER, "tree_cache"),
    attribute(SCHEDULER, "req_to_token_pool"),
    attribute(SCHEDULER, "token_to_kv_pool_allocator"),
    attribute(SCHEDULER, "model_config"),
    attribute(SCHEDULER, "spec_algorithm"),
    attribute(REQ, "output_ids"),
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
    attribute("sglang.srt.mem_cache.memory_pool.ReqToTokenPool", "device"),
    attribute("sglang.srt.mem_cache.memory_pool.ReqToTokenPool", "req_to_token"),
)
def _decode_batch(scheduler: Any, rows: Sequence[tuple[Any, int, int]]) -> Any:
    """A DECODE ScheduleBatch of ``rows`` (request, prompt length, held position i): row i
    of a request feeds ``output_ids[i]`` into the KV slot at ``prompt_len + i`` and
    attends up to it."""
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
    return batch


@relies(
    attribute(SCHEDULER, "tp_worker"),
    attribute("sglang.srt.managers.utils.GenerationBatchResult", "logits_output"),
    method("sglang.srt.managers.tp_worker.TpModelWorker", "forward_batch_generation", "batch", "is_verify"),
)
def _decode_forward(scheduler: Any, rows: Sequence[tuple[Any, int, int]]) -> torch.Tensor:
    """One DECODE forward over ``rows`` (:func:`_decode_batch`). Every layer writes the KV
    of all rows before any row attends. Returns the (rows, vocab) float32 CPU logits, one
    per row, in order."""
    result = scheduler.tp_worker.forward_batch_generation(_decode_batch(scheduler, rows), is_verify=True)
    logits = next_token_logits(result.logits_output)
    if logits.shape[0] != len(rows):
        raise RuntimeError(f"verify forward gave {logits.shape[0]} logit rows for {len(rows)}")
    return logits.float().cpu()


# ---- the verify pass layer by layer, as the Residual lands ------------------------------------

# The models whose forward the layerwise pass repeats call by call (their ``forward`` and
# their ``model.forward``), with the keywords their final norm takes. Any other model
# verifies in decode steps.
_LAYERWISE_MODELS: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": {},
    "Qwen2ForCausalLM": {"skip_empty": True},
}
_RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner"
_LLAMA = "sglang.srt.models.llama"
_QWEN2 = "sglang.srt.models.qwen2"
# Where a forward batch's residual stream starts and ends (a module of functions).
_RESIDUAL_BATCH = "sglang.srt.layers.layer_boundary.residual.batch"


def _in_each_model(kind: str, *names: str) -> tuple[Relied, ...]:
    """The attributes ``names`` of each layerwise model's class ``kind`` (``ForCausalLM``,
    ``Model``): the models' stacks are alike, each is checked on its own."""
    return tuple(
        attribute(f"{module}.{prefix}{kind}", name)
        for module, prefix in ((_LLAMA, "Llama"), (_QWEN2, "Qwen2"))
        for name in names
    )


@dataclass
class LayerwiseRows:
    """One request's held rows in the layerwise verify pass: row i (feeding ``output_ids[i]``
    at position ``prompt_len + i``) as its own 1-row decode forward batch, and its hidden
    state after the first ``layers`` layers, which every row has been through."""

    batches: list[Any] = field(default_factory=list)
    hidden: list[torch.Tensor] = field(default_factory=list)
    layers: int = 0


@relies(
    attribute(SCHEDULER, "tp_size"),
    attribute(SCHEDULER, "tp_worker"),
    attribute("sglang.srt.managers.tp_worker.TpModelWorker", "model_runner"),
    attribute(_RUNNER, "model"),
    attribute(_RUNNER, "decode_cuda_graph_runner"),
    attribute(_RUNNER, "hisparse_coordinator"),
    attribute(_RUNNER, "eager_runner"),
    attribute("sglang.srt.model_executor.runner.eager_runner.EagerRunner", "enable_pdmux"),
    *_in_each_model("ForCausalLM", "capture_aux_hidden_states", "pp_group", "model"),
    *_in_each_model("Model", "layers_to_capture"),
    attribute("sglang.srt.distributed.parallel_state.GroupCoordinator", "is_first_rank"),
    attribute("sglang.srt.distributed.parallel_state.GroupCoordinator", "is_last_rank"),
)
def layerwise_unsupported(scheduler: Any) -> str | None:
    """Why this server cannot verify held rows layer by layer with its decode step's
    calls, or None if it can."""
    if scheduler.tp_size != 1:  # each layer's collectives would need every rank to run it then
        return f"it runs tensor parallel ({scheduler.tp_size} ranks)"
    runner = scheduler.tp_worker.model_runner
    model = runner.model
    name = type(model).__name__
    if name not in _LAYERWISE_MODELS:
        return f"its model is a {name}, the layerwise pass knows {', '.join(_LAYERWISE_MODELS)}"
    if runner.decode_cuda_graph_runner not in (None, runner.eager_runner):
        return "its decode steps replay a graph, which rows computed layer by layer would not"
    if runner.hisparse_coordinator is not None or runner.eager_runner.enable_pdmux:
        return "its decode steps run with HiSparse or PD multiplexing"
    if not (model.pp_group.is_first_rank and model.pp_group.is_last_rank):
        return "it runs pipeline parallel"
    if model.capture_aux_hidden_states or model.model.layers_to_capture:
        return "its model captures auxiliary hidden states"
    return None


@relies(
    attribute(_RUNNER, "attn_backend"),
    attribute(_RUNNER, "eager_runner"),
    method("sglang.srt.model_executor.runner.base_runner.BaseRunner", "model_context"),
    attribute("sglang.srt.model_executor.forward_context.ForwardContext", "attn_backend"),
    Relied("sglang.srt.model_executor.forward_context", "ForwardContext", "class"),
    method("sglang.srt.model_executor.forward_context", "forward_context", "ctx", "forward_batch"),
    method(
        "sglang.srt.layers.attention.base_attn_backend.AttentionBackend",
        "init_forward_metadata",
        "forward_batch",
    ),
)
def _row_context(runner: Any, forward_batch: Any) -> contextlib.ExitStack:
    """What a decode step's forward runs under (the eager runner's model context and
    forward context, the attention backend's metadata of its batch), for one row's call."""
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context

    stack = contextlib.ExitStack()
    stack.enter_context(runner.eager_runner.model_context())
    context = ForwardContext(attn_backend=runner.attn_backend)
    stack.enter_context(forward_context(context, forward_batch=forward_batch))
    runner.attn_backend.init_forward_metadata(forward_batch)
    return stack


@relies(
    attribute(SCHEDULER, "tp_worker"),
    attribute("sglang.srt.managers.tp_worker.TpModelWorker", "model_runner"),
    attribute(_RUNNER, "model"),
    attribute(REQ, "output_ids"),
    method(
        f"{_FORWARD_BATCH_INFO}.ForwardBatch",
        "init_new",
        "batch",
        "model_runner",
        "capture_hidden_mode",
        "return_hidden_states_before_norm",
    ),
    attribute(f"{_FORWARD_BATCH_INFO}.ForwardBatch", "input_ids"),
    attribute(f"{_FORWARD_BATCH_INFO}.ForwardBatch", "positions"),
    *_in_each_model("ForCausalLM", "model"),
    *_in_each_model("Model", "embed_tokens", "layers", "start_layer"),
    method(f"{_LLAMA}.LlamaDecoderLayer", "forward", "positions", "hidden_states", "forward_batch"),
    method(f"{_QWEN2}.Qwen2DecoderLayer", "forward", "positions", "hidden_states", "forward_batch"),
    method(_RESIDUAL_BATCH, "start", "forward_batch"),
)
def advance_layerwise(scheduler: Any, req: Any, prompt_len: int, rows: LayerwiseRows, layers: int) -> None:
    """Bring ``rows`` up to the held tokens of ``req`` (a prompt of ``prompt_len`` tokens;
    a new row runs at once through the layers the others went through), then run every
    row through the first ``layers`` layers (the request's prompt KV there must hold its
    full-precision values): layer by layer, each layer row by row in order, so row i
    attends to the KV the rows before it wrote there, as in decode step i. Each row makes
    the calls of a 1-row decode step (``forward`` of the supported models,
    :func:`layerwise_unsupported`): its hidden state and the KV it writes are that
    step's, bit for bit."""
    from sglang.srt.layers.layer_boundary.residual import batch
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    runner = scheduler.tp_worker.model_runner
    stack = runner.model.model
    first = stack.start_layer
    hidden_states = rows.hidden
    with torch.no_grad():
        for i in range(len(rows.batches), len(req.output_ids) - 1):
            forward_batch = ForwardBatch.init_new(
                _decode_batch(scheduler, [(req, prompt_len, i)]),
                runner,
                capture_hidden_mode=None,
                return_hidden_states_before_norm=False,
            )
            with _row_context(runner, forward_batch):
                batch.start(forward_batch)
                hidden = stack.embed_tokens(forward_batch.input_ids)
                for layer in range(first, first + rows.layers):
                    hidden = stack.layers[layer](forward_batch.positions, hidden, forward_batch)
            rows.batches.append(forward_batch)
            hidden_states.append(hidden)
        for layer in range(first + rows.layers, first + layers):
            for n, forward_batch in enumerate(rows.batches):
                with _row_context(runner, forward_batch):
                    hidden_states[n] = stack.layers[layer](
                        forward_batch.positions, hidden_states[n], forward_batch
                    )
        rows.layers = max(rows.layers, layers)


@relies(
    attribute(SCHEDULER, "tp_worker"),
    attribute("sglang.srt.managers.tp_worker.TpModelWorker", "model_runner"),
    attribute(_RUNNER, "model"),
    attribute(f"{_FORWARD_BATCH_INFO}.ForwardBatch", "input_ids"),
    *_in_each_model("ForCausalLM", "model", "logits_processor", "lm_head"),
    *_in_each_model("Model", "norm"),
    method(
        "sglang.srt.layers.logits_processor.LogitsProcessor",
        "forward",
        "input_ids",
        "hidden_states",
        "lm_head",
        "logits_metadata",
    ),
    method(_RESIDUAL_BATCH, "final_norm", "hidden_states", "forward_batch", "layernorm", "skip_empty"),
)
def layerwise_logits(scheduler: Any, rows: LayerwiseRows) -> torch.Tensor:
    """The (rows, vocab) float32 CPU logits of ``rows``, which went through every layer:
    the final norm and the logits of a 1-row decode step, row by row."""
    from sglang.srt.layers.layer_boundary.residual import batch

    runner = scheduler.tp_worker.model_runner
    model = runner.model
    norm_keywords = _LAYERWISE_MODELS[type(model).__name__]
    logits = []
    with torch.no_grad():
        for forward_batch, hidden in zip(rows.batches, rows.hidden, strict=True):
            with _row_context(runner, forward_batch):
                normed = batch.final_norm(hidden, forward_batch, model.model.norm, **norm_keywords)
                output = model.logits_processor(forward_batch.input_ids, normed, model.lm_head, forward_batch)
            logits.append(next_token_logits(output).float().cpu())
    return torch.cat(logits)
