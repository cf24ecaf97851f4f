"""The option tables users read (README.md and docs/running.md, "## Options") list every
``--lynx-*`` flag of :class:`lynx.settings.LynxSettings` with its real default, and no flag
that is not one: a default changed in the code fails here until the docs say it too."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from lynx import settings
from lynx.mode import Mode
from lynx.settings import LynxSettings

ROOT = Path(__file__).resolve().parents[2]
DOCS = ("README.md", "docs/running.md")


def shown_default(field: str, value: object) -> str:
    """A default as the tables write it."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, Mode):
        return f"`{value.value}`"
    if isinstance(value, str):
        return f"`{value}`" if value else "none"
    if field.endswith("_bytes") and isinstance(value, int) and value:
        for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
            if value % size == 0:
                return f"{value // size}{unit}"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def options_table(path: str) -> dict[str, str]:
    """flag -> its default cell, from the first table after the "## Options" heading (a row
    may name several flags that share a default)."""
    text = (ROOT / path).read_text()
    section = text.split("\n## Options", 1)[1]
    rows: dict[str, str] = {}
    for line in section.splitlines()[1:]:
        if line.startswith("## "):
            break
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not cells[0].startswith("`--lynx"):
            continue
        for flag in re.findall(r"`(--lynx[a-z-]*)`", cells[0]):
            rows[flag] = cells[1]
    return rows


@pytest.mark.parametrize("path", DOCS)
def test_every_flag_is_in_the_table_with_its_default(path: str) -> None:
    table = options_table(path)
    defaults = LynxSettings()
    expected = {
        settings.flag_of(f.name): shown_default(f.name, getattr(defaults, f.name))
        for f in dataclasses.fields(LynxSettings)
    }
    assert table.pop("--lynx") == "off"
    assert table == expected
