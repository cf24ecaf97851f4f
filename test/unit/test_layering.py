"""The core never reaches into SGLang or the glue: ``python/lynx`` imports neither
``sglang`` nor ``lynx_patches``, not even lazily inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).parents[2] / "python" / "lynx"
FORBIDDEN = ("sglang", "sglang_router", "lynx_patches")


def _imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_core_imports_neither_sglang_nor_the_glue() -> None:
    files = sorted(CORE.rglob("*.py"))
    assert len(files) > 20
    offenders = {
        str(path.relative_to(CORE)): sorted(_imported_roots(path) & set(FORBIDDEN))
        for path in files
        if _imported_roots(path) & set(FORBIDDEN)
    }
    assert not offenders, f"the core imports SGLang or lynx_patches: {offenders}"


def test_the_check_sees_a_lazy_import(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from sglang.srt import utils\n    import lynx_patches.upstream\n")
    assert _imported_roots(module) == {"sglang", "lynx_patches"}
