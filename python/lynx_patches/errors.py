"""Errors the glue raises, in a leaf module: the boundary (:mod:`lynx_patches.upstream`)
and the runtime both raise them, and neither may import the other for it."""

from __future__ import annotations


class LynxConfigError(RuntimeError):
    """This server's KV pool or parallelism cannot run Lynx (raised at start-up)."""
