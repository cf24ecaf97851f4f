"""Progressive KV codec: an Anchor (upper ``anchor_bits`` of an INT8-resolution code plus
group minimum and scale) and a Residual (the original words, coded losslessly against the
Anchor; or the remaining bits of an INT8 code).

Public API: ``CodecConfig``, ``encode``/``decode`` (tensors), ``KVLayout``,
``segment_nbytes``, ``encode_pages``/``decode_pages``/``check_pages`` (SGLang-style KV pool),
``residual_nbytes_of`` (the travelling length of a segment's Residual), ``residual_layer_ends``
(where each layer's bytes of it end), ``warm_up``
(load the native codec before the first request; it names the ``CodecBackend`` that runs), the wire
format (``WIRE_VERSION``, ``CodecConfig.to_wire``/``from_wire``, ``KVLayout.to_wire``)
and the errors. The byte layout is documented in ``lynx.codec.format``.
"""

from .api import Encoded, decode, encode
from .backend import CodecBackend, warm_up
from .format import (
    WIRE_VERSION,
    CodecConfig,
    CodecError,
    CodecInputError,
    KVLayout,
    WireMismatchError,
    segment_nbytes,
)
from .pages import (
    check_pages,
    decode_pages,
    encode_pages,
    enqueue_anchor_pages,
    kv_layout_of,
    residual_layer_ends,
    residual_nbytes_of,
)

__all__ = [
    "WIRE_VERSION",
    "CodecBackend",
    "CodecConfig",
    "CodecError",
    "CodecInputError",
    "Encoded",
    "KVLayout",
    "WireMismatchError",
    "check_pages",
    "decode",
    "decode_pages",
    "encode",
    "encode_pages",
    "enqueue_anchor_pages",
    "kv_layout_of",
    "residual_layer_ends",
    "residual_nbytes_of",
    "segment_nbytes",
    "warm_up",
]
