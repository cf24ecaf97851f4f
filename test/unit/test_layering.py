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


GLUE = CORE.parent / "lynx_patches"


def _package_imports(path: Path, package: str) -> set[str]:
    """The modules and packages of ``package`` that ``path`` imports, at its top or inside a
    function (for ``lynx_patches``: ``from lynx_patches.x import y`` counts ``lynx_patches.x``
    and, where it is a module, ``lynx_patches.x.y``)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.startswith(package):
                names.add(node.module)
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names if alias.name.startswith(f"{package}."))
    return names


def _module_name(path: Path) -> str:
    parts = path.relative_to(GLUE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (module -> modules it imports), or None."""
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> list[str] | None:
        if module in path:
            return [*path[path.index(module) :], module]
        if module in done:
            return None
        for imported in sorted(graph.get(module, ())):
            found = visit(imported, [*path, module])
            if found:
                return found
        done.add(module)
        return None

    return next((c for c in (visit(m, []) for m in sorted(graph)) if c), None)


def test_the_glue_modules_import_one_another_without_a_cycle() -> None:
    # The package's own __init__ imports every hook module to register them: it is the
    # root, not a module the others may import. The boundary package (``upstream``) and its
    # topic modules are nodes like the rest.
    paths = [
        path
        for path in sorted(GLUE.rglob("*.py"))
        if path != GLUE / "__init__.py" and "_cpu_shims" not in path.parts
    ]
    modules = {_module_name(path): path for path in paths}
    graph = {
        name: _package_imports(path, "lynx_patches") & (set(modules) - {name})
        for name, path in modules.items()
    }
    assert len(graph) > 20 and "lynx_patches.upstream.verify_forward" in graph
    assert _cycle(graph) is None, f"import cycle among the glue modules: {' -> '.join(_cycle(graph) or [])}"


GPU_CHECK = CORE / "tools" / "gpu_check"


def test_the_gpu_check_steps_import_none_of_each_other() -> None:
    # A step imports what the steps share (common, options, device), never another step;
    # the runner imports the steps, and the package's __init__ re-exports from them all.
    paths = [path for path in sorted(GPU_CHECK.glob("*.py")) if path.stem not in ("__init__", "__main__")]
    modules = {_module_name(path): path for path in paths}
    graph = {
        name: _package_imports(path, "lynx.tools.gpu_check") & (set(modules) - {name})
        for name, path in modules.items()
    }
    steps = {name for name in modules if name.endswith("_step")}
    assert len(steps) == 4 and graph["lynx.tools.gpu_check.runner"] >= steps
    for step in sorted(steps):
        assert not graph[step] & steps, f"{step} imports another step: {sorted(graph[step] & steps)}"
    assert _cycle(graph) is None, f"import cycle in the GPU check: {' -> '.join(_cycle(graph) or [])}"


def test_the_cycle_check_finds_a_loop() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_the_core_has_no_import_cycle() -> None:
    # A package's __init__ re-exports its modules: importing the package counts as
    # importing its __init__, which may import any of its own modules, never back.
    paths = sorted(CORE.rglob("*.py"))
    modules = {_module_name(path): path for path in paths}
    graph = {name: _package_imports(path, "lynx") & (set(modules) - {name}) for name, path in modules.items()}
    assert "lynx.transfer.offers" in graph["lynx.transfer.sender"]
    assert "lynx.speculative.verifier" in graph["lynx.speculative.decoder"]
    assert _cycle(graph) is None, f"import cycle in the core: {' -> '.join(_cycle(graph) or [])}"


MAX_CLASS_LINES = 500


def test_no_class_is_over_500_lines() -> None:
    over = {
        node.name
        for path in sorted(CORE.parent.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.ClassDef) and (node.end_lineno or 0) - node.lineno >= MAX_CLASS_LINES
    }
    assert not over, f"classes over {MAX_CLASS_LINES} lines: {sorted(over)}"
