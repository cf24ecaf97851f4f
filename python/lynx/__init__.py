"""Lynx core: progressive (Anchor/Residual) KV codec, priority transfer lanes, verification.

Engine-agnostic: nothing under ``lynx`` imports SGLang. The SGLang glue lives in
``lynx_patches``.
"""

__version__ = "0.1.0"
