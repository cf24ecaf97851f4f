"""Shared fixtures: model folders built from the package index or locally."""

from __future__ import annotations

from pathlib import Path

import pytest

from lynx.tools import models


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return models.prepare_tiny()
