"""Print the requirements an image of this repo installs, one per line, read from
pyproject.toml: the build system's, the project's and those of each extra named.

    python3 docker/requirements.py [--pyproject FILE] EXTRA...

The Dockerfile installs them before it copies the source (a cached layer), and
scripts/compose.sh downloads the same list as wheels for an offline build, so the two
cannot drift apart. Standard library only: it runs on a bare base image.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import tomllib


def requirements(pyproject: dict, extras: list[str]) -> list[str]:
    optional = pyproject["project"].get("optional-dependencies", {})
    unknown = [extra for extra in extras if extra not in optional]
    if unknown:
        raise KeyError(f"no extra {', '.join(unknown)} in pyproject.toml (it has: {', '.join(optional)})")
    lines = [*pyproject["build-system"]["requires"], *pyproject["project"]["dependencies"]]
    lines += [req for extra in extras for req in optional[extra]]
    return list(dict.fromkeys(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="docker/requirements.py", description=__doc__.split("\n")[0])
    parser.add_argument("extras", nargs="*")
    parser.add_argument(
        "--pyproject", type=Path, default=Path(__file__).resolve().parents[1] / "pyproject.toml"
    )
    args = parser.parse_args(argv)
    try:
        lines = requirements(tomllib.loads(args.pyproject.read_text()), args.extras)
    except KeyError as exc:
        parser.exit(2, f"error: {exc.args[0]}\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
