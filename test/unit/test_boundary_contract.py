"""The boundary keeps its contract honest: every upstream name an accessor of
``lynx_patches/upstream/`` touches is declared on that accessor (``@relies``), and every
one a hook module reads directly (public request and batch fields) is in ``CONTRACT``,
which the plugin tests check against the installed SGLang.

Read from the boundary's source (AST), without SGLang: in each function, the values that
come from upstream are its parameters typed ``Any`` (upstream objects cross the boundary
untyped), the names it imports from ``sglang``, and whatever it computes from them. Every
attribute read or written on such a value, every keyword passed to a method called on one,
and every positional argument beyond those declared must be in ``CONTRACT`` (by name:
the plugin test checks owner and signature); a few names of Python containers, tensors
and events are not upstream's (``NOT_UPSTREAM``), nor are the ``lynx_*`` fields of Lynx's
subclasses of upstream classes."""

from __future__ import annotations

import ast
import importlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from lynx_patches import upstream
from lynx_patches.upstream import Relied
from lynx_patches.upstream.contract import RELIES

BOUNDARY = Path(upstream.__file__).parent
# Methods and fields of the Python, torch and CUDA objects upstream hands over (lists,
# dicts, deques, tensors, events, bytes): never upstream's own names.
NOT_UPSTREAM = frozenset(
    {
        "append",
        "extend",
        "get",
        "items",
        "keys",
        "values",
        "pop",
        "popleft",
        "setdefault",
        "tolist",
        "item",
        "to",
        "cpu",
        "float",
        "shape",
        "split",
        "synchronize",
        "update",
    }
)
GLUE = BOUNDARY.parent
# The contract checker itself: it inspects upstream's classes by name, uses none of them.
CHECKER = BOUNDARY / "contract.py"


# Builtins whose result holds what their arguments hold (``for req in zip(reqs, ...)``).
_PASS_THROUGH = frozenset({"zip", "enumerate", "list", "tuple", "sorted", "reversed", "iter", "next"})


def _from_upstream(node: ast.AST | None, values: set[str]) -> bool:
    """``node`` evaluates to an upstream value: one of ``values``, a field, item or method
    result of one, or a pass-through builtin or container of one. A call of any other
    function (Lynx's, ``len``) gives a value of its own."""
    if isinstance(node, ast.Name):
        return node.id in values
    if isinstance(node, ast.Attribute | ast.Subscript | ast.Starred):
        return _from_upstream(node.value, values)
    if isinstance(node, ast.Call):
        if isinstance(node.func, ast.Name) and node.func.id in _PASS_THROUGH:
            return any(_from_upstream(arg, values) for arg in node.args)
        return _from_upstream(node.func, values)
    if isinstance(node, ast.Tuple | ast.List | ast.BoolOp):
        return any(
            _from_upstream(e, values)
            for e in (node.elts if not isinstance(node, ast.BoolOp) else node.values)
        )
    if isinstance(node, ast.ListComp | ast.GeneratorExp):
        return _from_upstream(node.elt, values)
    if isinstance(node, ast.IfExp):
        return _from_upstream(node.body, values) or _from_upstream(node.orelse, values)
    return False


def _targets(node: ast.AST) -> Iterator[ast.expr]:
    if isinstance(node, ast.Assign):
        yield from node.targets
    elif isinstance(node, ast.AnnAssign | ast.AugAssign | ast.For | ast.comprehension):
        yield node.target
    elif isinstance(node, ast.withitem) and node.optional_vars is not None:
        yield node.optional_vars


def _source_of(node: ast.AST) -> ast.AST | None:
    if isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
        return node.value
    if isinstance(node, ast.For | ast.comprehension):
        return node.iter
    if isinstance(node, ast.withitem):
        return node.context_expr
    return None


def _upstream_values(function: ast.FunctionDef, imported: set[str]) -> set[str]:
    """Names in ``function`` that hold upstream values (see the module docstring)."""
    args = [*function.args.posonlyargs, *function.args.args, *function.args.kwonlyargs]
    values = {a.arg for a in args if a.annotation is not None and "Any" in ast.unparse(a.annotation)}
    values |= imported
    while True:
        found = {
            sub.id
            for node in ast.walk(function)
            if _from_upstream(_source_of(node), values)
            for target in _targets(node)
            for sub in ast.walk(target)
            if isinstance(sub, ast.Name)
        }
        if found <= values:
            return values
        values |= found


def _sglang_imports(function: ast.FunctionDef) -> list[tuple[str, str]]:
    return [
        (node.module, alias.asname or alias.name)
        for node in ast.walk(function)
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sglang")
        for alias in node.names
    ]


def _unfit(call: ast.Call, method: str, signatures: list[tuple[str, ...]]) -> list[str]:
    """Why ``call`` fits none of the declared ``signatures`` of ``method``: a keyword not
    declared, or more positional arguments than declared parameters (their names and
    order are what the plugin test checks)."""
    keywords = {k.arg for k in call.keywords if k.arg is not None}
    fits = [p for p in signatures if keywords <= set(p) and len(call.args) <= max(1, len(p))]
    if fits:
        return []
    best = max(signatures, key=len)
    unknown = sorted(keywords - set(best))
    if unknown:
        return [f".{method}({unknown[0]}=...)"]
    return [f".{method}() with {len(call.args)} positional arguments, {len(best)} declared"]


def undeclared(source: str, declaration: Callable[[str], Iterable[Relied]]) -> list[str]:
    """Each use of an upstream name in ``source``'s functions that the function's
    declaration (``declaration(name)``) does not hold, as ``function: what``."""
    problems = []
    for function in ast.parse(source).body:
        if not isinstance(function, ast.FunctionDef):
            continue
        where = function.name
        contract = tuple(declaration(where))
        names = {r.name for r in contract}
        signatures: dict[str, list[tuple[str, ...]]] = {}
        for r in contract:
            if r.kind == "method":
                signatures.setdefault(r.name, []).append(r.params)
        owners = {r.owner for r in contract} | {f"{r.owner}.{r.name}" for r in contract}
        imports = _sglang_imports(function)
        for module, name in imports:
            declared = f"{module}.{name}" in owners or any(
                r.owner == module and r.name == name for r in contract
            )
            if not declared:
                problems.append(f"{where}: imports {module}.{name}")
        values = _upstream_values(function, {name for _, name in imports})
        for node in ast.walk(function):
            touched = isinstance(node, ast.Attribute) and _from_upstream(node.value, values)
            lynx_own = isinstance(node, ast.Attribute) and node.attr.startswith("lynx_")
            if touched and not lynx_own and node.attr not in names and node.attr not in NOT_UPSTREAM:
                problems.append(f"{where}: .{node.attr}")
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if (
                isinstance(func, ast.Name)
                and func.id in ("getattr", "setattr", "hasattr")
                and len(node.args) > 1
            ):
                obj, attr = node.args[0], node.args[1]
                literal = isinstance(attr, ast.Constant) and isinstance(attr.value, str)
                lynx_own = literal and attr.value.startswith("lynx_")
                if literal and not lynx_own and _from_upstream(obj, values) and attr.value not in names:
                    problems.append(f"{where}: {func.id}(..., {attr.value!r})")
            if (
                isinstance(func, ast.Attribute)
                and func.attr in signatures
                and _from_upstream(func.value, values)
            ):
                problems += [f"{where}: {why}" for why in _unfit(node, func.attr, signatures[func.attr])]
    return problems


def declared_on(path: Path) -> Callable[[str], tuple[Relied, ...]]:
    """Function name -> what it declares on itself (``@relies``) in the boundary module at
    ``path``. ``__main__`` runs the check when imported and declares nothing."""
    if path.stem == "__main__":
        return lambda _name: ()
    package = upstream.__name__
    module = importlib.import_module(package if path.stem == "__init__" else f"{package}.{path.stem}")
    return lambda name: getattr(getattr(module, name), RELIES, ())


def test_every_accessor_declares_each_upstream_name_it_touches_on_itself() -> None:
    modules = sorted(path for path in BOUNDARY.glob("*.py") if path != CHECKER)
    assert len(modules) >= 5
    problems = [
        f"{path.name}: {p}" for path in modules for p in undeclared(path.read_text(), declared_on(path))
    ]
    assert not problems, "upstream names an accessor uses and does not declare:\n" + "\n".join(problems)


def test_the_contract_is_what_the_accessors_and_the_topic_modules_declare() -> None:
    topics = [
        upstream.connector,
        upstream.first_token,
        upstream.requests,
        upstream.scheduler,
        upstream.verify_forward,
    ]
    declared_by_accessors = {
        relied for topic in topics for value in vars(topic).values() for relied in getattr(value, RELIES, ())
    }
    assert declared_by_accessors and declared_by_accessors <= set(upstream.CONTRACT)
    rest = {relied for topic in topics for relied in topic.RELIED}
    assert set(upstream.CONTRACT) == declared_by_accessors | rest | set(upstream.contract.RELIED)
    assert len(upstream.CONTRACT) == len(set(upstream.CONTRACT))  # each name once


def test_hook_modules_read_only_declared_upstream_names() -> None:
    modules = sorted(GLUE.glob("*.py"))  # the boundary package is not among them
    assert len(modules) > 15
    problems = [
        f"{path.name}: {p}"
        for path in modules
        for p in undeclared(path.read_text(), lambda _name: upstream.CONTRACT)
    ]
    assert not problems, "upstream names used but not in upstream.CONTRACT:\n" + "\n".join(problems)


def test_the_check_finds_what_a_change_adds_without_declaring() -> None:
    contract = (
        Relied("sglang.x.Pool", "free", "method", ("rows",)),
        Relied("sglang.x.Pool", "size", "attribute"),
        Relied("sglang.x", "Pool", "class"),
    )
    source = """
def fine(pool: Any, n: int) -> int:
    pool.free(rows=[n])
    return pool.size + len([n]).bit_length()

def drifted(pool: Any, lynx_thing: Thing) -> None:
    from sglang.x import Pool, Other
    rows = pool.rows_cpu
    rows.device
    pool.free(rows=[1], force=True)
    pool.free(1, 2)
    getattr(pool, "hidden", None)
    lynx_thing.anything
    Pool.size
"""
    assert undeclared(source, lambda _name: contract) == [
        "drifted: imports sglang.x.Other",
        "drifted: .rows_cpu",
        "drifted: .device",
        "drifted: .free(force=...)",
        "drifted: .free() with 2 positional arguments, 1 declared",
        "drifted: getattr(..., 'hidden')",
    ]
