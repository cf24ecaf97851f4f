"""Real SGLang servers, started once per test module (they take minutes on 2 cores), and
the few that several modules use alike, started once for all of them (``shared``)."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pdtools import CHECKS, SPEC_EXACT, Prefill, batch_variant, decode_server

from lynx.tools.cluster import SingleServer, start_together, stop_together

LOG_ROOT = Path(os.environ.get("LYNX_TEST_LOG_DIR", Path(__file__).resolve().parents[2] / "logs" / "tests"))


@pytest.fixture(scope="module")
def log_dir(request: pytest.FixtureRequest) -> Path:
    return LOG_ROOT / request.module.__name__.rsplit(".", 1)[-1]


START_S_PER_SERVER = 120.0

# What a server log says when something went wrong: CI keeps only pytest's output, so a
# failing test carries these lines of the logs it may have read.
TROUBLE = re.compile(r"error|fail|exception|traceback|abort|refus|timed? ?out", re.IGNORECASE)
# ... but not what every start prints
STARTUP = re.compile(r"server_args=|Ignore import error|Custom allreduce failed")
TROUBLE_LINES_PER_LOG = 20


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if not report.failed:
        return
    module = getattr(item, "module", None)
    name = module.__name__.rsplit(".", 1)[-1] if module is not None else ""
    for log in sorted([*(LOG_ROOT / name).glob("*.log"), *(LOG_ROOT / "shared").glob("*.log")]):
        lines = [
            line
            for line in log.read_text(errors="replace").splitlines()
            if TROUBLE.search(line) and not STARTUP.search(line)
        ]
        if lines:
            tail = "\n".join(lines[-TROUBLE_LINES_PER_LOG:])
            report.sections.append((f"{log.parent.name}/{log.name}: its last lines of trouble", tail))


class SharedServers:
    """Servers that several modules use alike: each starts with the first module that names
    it in its ``SHARED_SERVERS`` (together with that module's own servers) and stops after
    the last such module of the session. ``SHARED_SERVERS`` is a tuple of names, or a dict
    from the module's name for a server to the shared one's. A server start costs ~50 s on CI's two cores,
    mostly upstream's imports in each of its three processes.

    * ``P0``/``D0``: plain PD without Lynx (the reference);
    * ``PS``/``DS``: ``--lynx-mode speculative`` with the default (lossless) Residual held
      back ``SPEC_HOLD_S``, 2-bit Anchors; ``DS`` with ``--enable-metrics``.

    Both pairs compute in FP32 over a BF16 KV pool (``pdtools.batch_variant``)."""

    def __init__(self, session: pytest.Session, factories: dict[str, Callable[[], SingleServer]]) -> None:
        self._session = session
        self._factories = factories
        self._started: dict[str, SingleServer] = {}

    @contextlib.contextmanager
    def running(self, request: pytest.FixtureRequest, own: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """Start ``own`` and the module's shared servers not yet running, together; yield
        them all by name; stop ``own``, and the shared servers no later module names."""
        names = _shared_names(request.module)
        new = {name: self._factories[name]() for name in names.values() if name not in self._started}
        starting = [*own.values(), *new.values()]
        # Servers started together share the two cores: ten took 555-603 s (CI, this host).
        start_together(starting, max(600.0, START_S_PER_SERVER * len(starting)))
        self._started.update(new)
        try:
            yield {**own, **{local: self._started[name] for local, name in names.items()}}
        finally:
            stop_together([*own.values(), *self._pop(self._unused_after(request.module))])

    def _unused_after(self, module: Any) -> set[str]:
        items = self._session.items
        last = max(i for i, item in enumerate(items) if item.module is module)
        later = {name for item in items[last + 1 :] for name in _shared_names(item.module).values()}
        return set(self._started) - later

    def _pop(self, names: set[str]) -> list[SingleServer]:
        return [self._started.pop(name) for name in names]

    def stop_all(self) -> None:
        stop_together(self._pop(set(self._started)))


def _shared_names(module: Any) -> dict[str, str]:
    names = getattr(module, "SHARED_SERVERS", ())
    return dict(names) if isinstance(names, dict) else {name: name for name in names}


@pytest.fixture(scope="session")
def shared(request: pytest.FixtureRequest, tiny_model: Path) -> Iterator[SharedServers]:
    config = batch_variant(tiny_model, CHECKS)
    log = LOG_ROOT / "shared"
    servers = SharedServers(
        request.session,
        {
            "P0": lambda: Prefill(config, log, "P0", []),
            "D0": lambda: decode_server(config, log, "D0", []),
            "PS": lambda: Prefill(config, log, "PS", SPEC_EXACT),
            "DS": lambda: decode_server(config, log, "DS", [*SPEC_EXACT, "--enable-metrics"]),
        },
    )
    yield servers
    servers.stop_all()
