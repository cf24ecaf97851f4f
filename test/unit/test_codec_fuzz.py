"""A short run of the C++ lossless decoder's fuzz target under AddressSanitizer and
UndefinedBehaviorSanitizer (``scripts/fuzz_codec.sh``, ``fuzz/codec_fuzz.cpp``): valid bodies
round-trip, mutated bodies and Anchors decode or fault, and nothing reads or writes out of
bounds. Longer runs: ``scripts/fuzz_codec.sh 600 <seed>``."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SECONDS = 15

pytestmark = pytest.mark.skipif(
    platform.machine() != "x86_64" or shutil.which("g++") is None, reason="the codec is x86-64 C++ (g++)"
)


@pytest.fixture(scope="module")
def build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


def run(build: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "LYNX_FUZZ_BUILD": str(build)}
    return subprocess.run(
        [str(ROOT / "scripts" / "fuzz_codec.sh"), *args], env=env, capture_output=True, text=True, timeout=600
    )


def test_the_sanitizers_are_live_in_the_fuzz_build(build: Path) -> None:
    canary = run(build, "--canary")
    assert canary.returncode != 0
    assert "AddressSanitizer: heap-buffer-overflow" in canary.stderr


def test_mutated_bodies_and_anchors_never_read_or_write_out_of_bounds(build: Path) -> None:
    fuzz = run(build, str(SECONDS), "4601")
    assert fuzz.returncode == 0, fuzz.stderr[-4000:]
    found = re.search(r"codec_fuzz: (\d+) bodies, (\d+) faults, seed 4601", fuzz.stdout)
    assert found is not None, fuzz.stdout
    bodies, faults = int(found[1]), int(found[2])
    assert bodies > 10_000 and 0 < faults < bodies  # some mutations stay valid, most do not
