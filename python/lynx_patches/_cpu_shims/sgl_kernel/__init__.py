"""Lynx's stand-in for ``sgl_kernel`` on SGLang's CPU engine; see ``lynx_patches.sgl_kernel``."""

from collections.abc import Callable

from lynx_patches.sgl_kernel import (
    assign_req_to_token_pool_cpu,
    copy_all_layer_kv_cache_cpu,
    unavailable_op,
)

LYNX_STAND_IN = True

__all__ = ["assign_req_to_token_pool_cpu", "copy_all_layer_kv_cache_cpu"]


def __getattr__(name: str) -> Callable[..., object]:
    if name.startswith("__"):
        raise AttributeError(name)
    return unavailable_op(name)
