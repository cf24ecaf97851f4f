"""What a Lynx mode means, defined once: which streams prefill sends, when decode may
start, whether it verifies. Every side asks the mode instead of comparing its name."""

from __future__ import annotations

import enum


class Mode(str, enum.Enum):
    """``--lynx-mode``. A ``str`` so settings and ``/server_info`` carry its name."""

    FULL = "full"
    ANCHOR_ONLY = "anchor-only"
    SPECULATIVE = "speculative"

    @property
    def sends_residual(self) -> bool:
        """Prefill sends the Residual (only ``anchor-only`` does not)."""
        return self is not Mode.ANCHOR_ONLY

    @property
    def starts_on_anchor(self) -> bool:
        """Decode starts decoding once the Anchor landed, not waiting for the Residual."""
        return self is not Mode.FULL

    @property
    def verifies(self) -> bool:
        """Tokens decoded on the Anchor are held and verified when the Residual lands."""
        return self is Mode.SPECULATIVE

    @classmethod
    def parse(cls, name: str | Mode) -> Mode:
        try:
            return cls(name)
        except ValueError:
            names = ", ".join(m.value for m in cls)
            raise ValueError(f"--lynx-mode must be one of {names}, got {name!r}") from None

    def __str__(self) -> str:
        return self.value
