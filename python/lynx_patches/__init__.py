"""SGLang plugin entry point for Lynx (entry-point group ``sglang.srt.plugins``).

SGLang calls :func:`register` through ``sglang.srt.plugins.load_plugins()`` in the
launcher and in every scheduler/detokenizer subprocess, then applies the registered
hooks.  Each module of this package hooks one upstream module and lists its targets at
its top; together they are every upstream symbol Lynx touches:

* :mod:`lynx_patches.server_args` -- ``--lynx*`` flags, validation, CPU-engine defaults.
* :mod:`lynx_patches.internal_state` -- Lynx settings in ``/server_info``.
* :mod:`lynx_patches.tokenizer_manager` -- each parallel sample (``n`` > 1) its own
  bootstrap room.
* :mod:`lynx_patches.sgl_kernel` -- pure-torch stand-ins for the two CPU ops of
  ``sgl_kernel`` (CPU engine only).
* :mod:`lynx_patches.disaggregation_utils` -- Lynx's Mooncake manager, sender and
  receiver (:mod:`lynx_patches.mooncake_connector`) in place of upstream's with ``--lynx``.
* :mod:`lynx_patches.disaggregation_prefill` / :mod:`lynx_patches.disaggregation_decode`
  -- build the process's Lynx runtime on the KV pool (:mod:`lynx_patches.runtime`);
  CPU-engine guard on the early prefix send; speculative mode's admission and
  per-iteration verification (:mod:`lynx.speculative`, over SGLang by :mod:`lynx_patches.decode_engine`).
* :mod:`lynx_patches.output_streamer` -- the per-request transfer report in ``meta_info``;
  held tokens are not streamed.
* :mod:`lynx_patches.schedule_batch` -- held tokens and deferred finishes; parking instead
  of retraction.
* :mod:`lynx_patches.scheduler` -- parked requests count as in flight (idle check, abort);
  prefill's chunks announced before their forward.
* :mod:`lynx_patches.radix_attention` -- each layer's Anchor leaves once prefill wrote it
  (``--lynx-layerwise-from``).
* :mod:`lynx_patches.model_runner` -- the draft distributions of sampled held tokens.
* :mod:`lynx_patches.torch_native_backend` -- a verify pass's held rows attend in one call
  on the CPU attention backend.
* :mod:`lynx_patches.disaggregation_mooncake_conn` -- CPU-engine guard on pinned,
  event-synchronised page indices.
* :mod:`lynx_patches.distributed_parallel_state` -- CPU-engine fix for ``--tp-size > 1``:
  no PyNccl communicator for CPU groups.

Every SGLang internal the hooks rely on goes through :mod:`lynx_patches.upstream`, whose
contract a test checks against the pinned release. Without ``--lynx`` every Lynx hook
calls the original unchanged.  The CPU-engine hooks
are registered only when ``SGLANG_USE_CPU_ENGINE=1`` (upstream's own switch for the CPU
platform), because upstream PD serving cannot start on a CPU without them.
"""

from lynx_patches import (
    disaggregation_decode,
    disaggregation_mooncake_conn,
    disaggregation_prefill,
    disaggregation_utils,
    distributed_parallel_state,
    internal_state,
    model_runner,
    output_streamer,
    radix_attention,
    schedule_batch,
    scheduler,
    server_args,
    sgl_kernel,
    tokenizer_manager,
    torch_native_backend,
)
from lynx_patches._hooks import is_cpu_engine


def register() -> None:
    """Register Lynx's hooks with ``sglang.srt.plugins.hook_registry.HookRegistry``."""
    if is_cpu_engine():
        # Before any hook target is imported: their imports reach ``sgl_kernel``.
        sgl_kernel.install()
    server_args.register()
    internal_state.register()
    tokenizer_manager.register()
    disaggregation_utils.register()
    disaggregation_prefill.register()
    disaggregation_decode.register()
    output_streamer.register()
    schedule_batch.register()
    scheduler.register()
    model_runner.register()
    radix_attention.register()
    torch_native_backend.register()
    if is_cpu_engine():
        disaggregation_mooncake_conn.register()
        distributed_parallel_state.register()
