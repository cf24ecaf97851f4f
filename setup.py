"""Compiles the C++ CPU codec (python/lynx/codec/csrc) into the package as
``lynx.codec._cpu_codec`` when the package is built or installed (an editable install builds
it in place), so no server compiles anything. It is linked against the torch of the build
environment, which must be the torch that runs it: build and install with
``--no-build-isolation`` (scripts/install.sh and docker/Dockerfile do). Metadata:
pyproject.toml.
"""

from __future__ import annotations

import importlib.util
import platform
import sys
from pathlib import Path

from setuptools import setup

_spec = importlib.util.spec_from_file_location(
    "cpp_build", Path(__file__).parent / "python/lynx/codec/cpp_build.py"
)
assert _spec is not None and _spec.loader is not None
recipe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(recipe)

if platform.machine() != "x86_64":
    # The kernels are AVX2 intrinsics; elsewhere the server warns at start-up and runs the
    # torch reference.
    print(f"lynx: no C++ CPU codec on {platform.machine()} (x86-64 only)", file=sys.stderr)
    setup()
else:
    try:
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        sys.exit(
            "lynx: building the C++ CPU codec needs the torch it will run with: install torch first, "
            "then build with pip's --no-build-isolation"
        )
    setup(
        ext_modules=[
            CppExtension(
                recipe.MODULE,
                [f"python/lynx/codec/csrc/{recipe.SOURCES[0]}"],
                extra_compile_args=[*recipe.CFLAGS, f"-D{recipe.DIGEST_MACRO}={recipe.source_digest()}"],
                extra_link_args=list(recipe.LDFLAGS),
            )
        ],
        cmdclass={"build_ext": BuildExtension},
    )
