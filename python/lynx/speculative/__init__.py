"""Speculative decoding, engine-agnostic: :class:`SpeculativeDecoder` over a
:class:`DecodeEngine` (see :mod:`lynx.speculative.decoder`)."""

from lynx.speculative.decoder import SpeculativeDecoder
from lynx.speculative.engine import DecodeEngine, LayerRows, RowStop
from lynx.speculative.speculation import META_INFO_KEY, Speculation, Speculations

__all__ = [
    "META_INFO_KEY",
    "DecodeEngine",
    "LayerRows",
    "RowStop",
    "Speculation",
    "Speculations",
    "SpeculativeDecoder",
]
