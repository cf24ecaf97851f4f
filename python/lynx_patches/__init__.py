"""SGLang plugin entry point for Lynx (entry-point group ``sglang.srt.plugins``)."""


def register() -> None:
    """Called by ``sglang.srt.plugins.load_plugins`` in every SGLang process."""
