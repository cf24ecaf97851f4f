"""How the C++ CPU codec is compiled, shared by ``setup.py`` (which builds it into the package
as ``lynx.codec._cpu_codec`` when the package is built or installed) and ``cpp_backend.py``
(which refuses a module built from other sources or flags than those installed next to it).
Standard library only: ``setup.py`` loads this file by path, before the package (or torch)
can be imported.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

MODULE = "lynx.codec._cpu_codec"
CSRC = Path(__file__).parent / "csrc"
SOURCES = ("cpu_codec.cpp", "cpu_codec_kernels.h", "cpu_codec_lossless.h")  # the first is compiled
# x86-64-v3 (AVX2, FMA, F16C, BMI1/2, LZCNT, MOVBE), not -march=native: a wheel or an image is
# built on one host and runs on others. -ffp-contract=off and no -ffast-math: every float32
# operation rounds as torch's. -g0: Python's own flags may ask for debug information, which
# would make the module 30 times larger.
CFLAGS = ("-O3", "-march=x86-64-v3", "-ffp-contract=off", "-fopenmp", "-g0")
LDFLAGS = ("-fopenmp",)
# /proc/cpuinfo's names of the x86-64-v3 features the compiler may use ("abm": LZCNT); a CPU
# without one of them would die of an illegal instruction in the module.
CPU_FLAGS = ("avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe")
DIGEST_MACRO = "LYNX_CODEC_DIGEST"


def source_digest() -> str:
    """A digest of the sources and flags; the build bakes it into the module."""
    digest = hashlib.sha256(" ".join(CFLAGS + LDFLAGS).encode())
    for name in SOURCES:
        digest.update((CSRC / name).read_bytes())
    return digest.hexdigest()[:16]
