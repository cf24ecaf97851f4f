"""Real SGLang servers, started once per test module (they take minutes on 2 cores)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

LOG_ROOT = Path(os.environ.get("LYNX_TEST_LOG_DIR", Path(__file__).resolve().parents[2] / "logs" / "tests"))


@pytest.fixture(scope="module")
def log_dir(request: pytest.FixtureRequest) -> Path:
    return LOG_ROOT / request.module.__name__.rsplit(".", 1)[-1]
