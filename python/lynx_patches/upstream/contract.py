"""How the boundary's contract with SGLang is declared and checked.

Each accessor of :mod:`lynx_patches.upstream` declares, on itself, the upstream names it
touches (:func:`relies`); each topic module's ``RELIED`` lists the rest: the methods
Lynx's hooks wrap or its subclasses override, and the public fields hook modules read
directly. :data:`lynx_patches.upstream.CONTRACT` is the union of all of them
(:func:`declared_in`). Checked two ways: by :func:`contract_violations` against the
installed SGLang (``python -m lynx_patches.upstream``,
``test/plugin/test_upstream_contract.py``), and against the source by
``test/unit/test_boundary_contract.py``, which fails on any upstream name an accessor
touches and does not declare itself (and on any a hook module reads undeclared).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any, TypeVar

CONN = "sglang.srt.disaggregation.mooncake.conn"
COMMON_CONN = "sglang.srt.disaggregation.common.conn"
BASE_CONN = "sglang.srt.disaggregation.base.conn"
SCHEDULE_BATCH = "sglang.srt.managers.schedule_batch"
REQ = f"{SCHEDULE_BATCH}.Req"
BATCH = f"{SCHEDULE_BATCH}.ScheduleBatch"
SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"


@dataclass(frozen=True)
class Relied:
    """One upstream name Lynx relies on: ``owner`` (a module or a class, dotted) and the
    ``name`` in it; ``kind`` is ``function``/``class``/``member`` (module-level, or an enum
    member), ``method`` (on the class, with at least ``params``), or ``attribute`` (set on
    instances: ``self.<name> = ...`` somewhere in the class or its bases)."""

    owner: str
    name: str
    kind: str
    params: tuple[str, ...] = ()


def method(owner: str, name: str, *params: str) -> Relied:
    return Relied(owner, name, "method", params)


def attribute(owner: str, name: str) -> Relied:
    return Relied(owner, name, "attribute")


RELIES = "__lynx_relies__"  # where @relies keeps an accessor's declaration
Accessor = TypeVar("Accessor", bound=Callable[..., Any])


def relies(*names: Relied) -> Callable[[Accessor], Accessor]:
    """Declare on an accessor every upstream name it touches (fields read or written,
    methods called with their keywords, names imported from ``sglang``)."""

    def declare(accessor: Accessor) -> Accessor:
        setattr(accessor, RELIES, names)
        return accessor

    return declare


def declared_in(module: ModuleType) -> tuple[Relied, ...]:
    """What ``module``'s accessors declare, in source order, then its ``RELIED``."""
    accessors = [
        value
        for value in vars(module).values()
        if callable(value) and getattr(value, "__module__", None) == module.__name__
    ]
    return tuple(relied for accessor in accessors for relied in getattr(accessor, RELIES, ())) + tuple(
        getattr(module, "RELIED", ())
    )


# What the launcher-level hooks rely on: the plugin API they register through
# (lynx_patches._hooks) and the server flags they read.
RELIED: tuple[Relied, ...] = (
    # The plugin API the hooks register through (lynx_patches._hooks).
    Relied("sglang.srt.plugins.hook_registry", "HookRegistry", "class"),
    Relied("sglang.srt.plugins.hook_registry", "HookType", "class"),
    method("sglang.srt.plugins.hook_registry.HookRegistry", "register", "target", "hook", "hook_type"),
    *(
        attribute("sglang.srt.server_args.ServerArgs", name)
        for name in (
            "disaggregation_mode",
            "disaggregation_transfer_backend",
            "disaggregation_decode_retraction_backup",
            "disable_overlap_schedule",
            "tp_size",
            "attn_dp_size",
            "host",
            "enable_metrics",
            "speculative_algorithm",
            "disaggregation_decode_enable_radix_cache",
            "disaggregation_enable_kv_checksum",
        )
    ),
)


def _resolve(dotted: str) -> Any:
    """The module, class or member at ``dotted`` (a module path, then attributes)."""
    import importlib

    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(f"no module in {dotted}")


def _instance_attributes(cls: type) -> set[str]:
    """Names assigned as ``self.<name>`` in the source of ``cls`` and its bases, and the
    class-level (annotated or assigned) names."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass is not object:
            names |= _own_attributes(klass)
    return names


@functools.cache
def _own_attributes(klass: type) -> frozenset[str]:
    """What :func:`_instance_attributes` finds in ``klass`` itself. Cached: the contract
    names ~20 classes in ~130 entries, and parsing a class's source (the scheduler's is
    thousands of lines) is nearly all the check's time."""
    import ast
    import inspect
    import textwrap

    names = set(vars(klass)) | set(getattr(klass, "__annotations__", {}))
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
    except (OSError, TypeError, SyntaxError):
        return frozenset(names)
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets = [node.target]
        for target in targets:
            for sub in ast.walk(target):
                if (
                    isinstance(sub, ast.Attribute)
                    and isinstance(sub.value, ast.Name)
                    and sub.value.id == "self"
                ):
                    names.add(sub.attr)
    return frozenset(names)


def contract_violations(contract: Iterable[Relied]) -> list[str]:
    """Each relied-upon name the installed SGLang no longer has, as a sentence naming it."""
    import inspect

    problems = []
    for relied in contract:
        where = f"{relied.owner}.{relied.name}"
        try:
            owner = _resolve(relied.owner)
        except (ImportError, AttributeError) as exc:
            problems.append(f"{relied.owner}: cannot import ({exc})")
            continue
        if relied.kind == "attribute":
            if not isinstance(owner, type) or relied.name not in _instance_attributes(owner):
                problems.append(f"{where}: no such attribute is set on instances")
            continue
        if not hasattr(owner, relied.name):
            problems.append(f"{where}: missing")
            continue
        if relied.kind == "method":
            try:
                params = inspect.signature(getattr(owner, relied.name)).parameters
            except (TypeError, ValueError):
                continue
            missing = [p for p in relied.params if p not in params]
            if missing:
                problems.append(f"{where}: parameters {missing} missing (has {list(params)})")
    return problems
