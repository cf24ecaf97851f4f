"""Every SGLang internal Lynx relies on (``lynx_patches.upstream.CONTRACT`` and the
metadata frame layout) exists in the installed, pinned SGLang; and the check itself
notices a name that moved."""

from __future__ import annotations

import os
import subprocess
import sys

from lynx_patches import upstream
from lynx_patches.upstream import Relied

CPU_ENV = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1"}


def test_the_installed_sglang_has_everything_lynx_relies_on() -> None:
    # A fresh interpreter, as the server runs: the CPU engine's stand-ins installed, no hook applied.
    out = subprocess.run(
        [sys.executable, "-m", "lynx_patches.upstream"],
        capture_output=True,
        text=True,
        env=CPU_ENV,
        timeout=600,
    )
    assert out.returncode == 0, f"SGLang moved what Lynx relies on:\n{out.stdout}\n{out.stderr[-2000:]}"


def test_the_check_names_what_moved() -> None:
    moved = [
        Relied("lynx.transfer.receiver.ProgressiveReceiver", "write_kv_renamed", "method"),
        Relied("lynx.transfer.receiver.ProgressiveReceiver", "write_kv", "method", ("room", "no_such_param")),
        Relied("lynx.transfer.receiver.ProgressiveReceiver", "_no_such_field", "attribute"),
        Relied("lynx.transfer.no_such_module", "X", "class"),
    ]
    kept = [
        Relied("lynx.transfer.receiver.ProgressiveReceiver", "write_kv", "method", ("room", "slots")),
        Relied("lynx.transfer.receiver.ProgressiveReceiver", "_quarantine", "attribute"),
        Relied("lynx.transfer.protocol", "TAG", "member"),
    ]
    problems = upstream.contract_violations([*moved, *kept])
    assert len(problems) == len(moved), problems
    assert "write_kv_renamed: missing" in problems[0]
    assert "['no_such_param'] missing" in problems[1]
    assert "_no_such_field: no such attribute" in problems[2]
    assert "cannot import" in problems[3]


def test_metadata_frames_parse() -> None:
    frames = [b"42", b"10.0.0.1", b"7000", b"10.0.0.1:9", b"\x01\x00", b"3", b"", b"1", b"0", b""]
    meta = upstream.parse_metadata_frames(frames)
    assert meta == upstream.MetadataFrames(42, ("10.0.0.1", 7000), "10.0.0.1:9", False)
    assert upstream.parse_metadata_frames([b"REGISTER", *frames[1:]]) is None
    assert upstream.parse_metadata_frames(frames[:3]) is None
