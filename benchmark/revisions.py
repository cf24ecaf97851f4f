"""Checkouts of this repo side by side in one run: the same PD workload against each, to
show that a change preserves behaviour (the same bytes on the wire, the same outputs) and
what it does to the latency (TTFT and the time to each ``--marks`` token, within noise).

Each ``--revision NAME=PATH`` is a checkout's root whose ``python/`` holds ``lynx`` and
``lynx_patches`` and the compiled C++ codec (``python/lynx/codec/_cpu_codec*.so``,
untracked: a checkout without it is refused); the first is the baseline. A revision's
servers run with ``PYTHONPATH=PATH/python`` first, so the plugin SGLang loads through its
entry point (``sglang.srt.plugins``, which names modules, not paths) is that checkout's,
whatever the virtual environment installed. Before measuring, each revision's imports are
resolved in a child process with that environment (``lynx``, ``lynx_patches`` and the
plugin must come from ``PATH/python``, the C++ codec must load); each started server is
then checked: the C++ codec its processes mapped must be ``PATH/python``'s, and
``/server_info`` must not name the torch reference codec (70x slower: no fair timing).

For each ``--configs`` configuration (pd_transfer.CONFIGS) the revisions run one after
the other, in order and then in reverse (``--rounds``: 2 is ABBA), never two pairs at
once: per turn a fresh prefill + decode pair (pd_transfer.Pair, ``--link`` as there), one
warm-up request, then ``--repeats`` real-text prompts of each ``--contexts`` length, each
one streamed greedy request of ``max(--marks)`` tokens. Interleaving spreads a noisy
host's drift over every revision alike. Measured per (configuration, revision): TTFT and
the time to each mark (medians over prompts and rounds), the KV bytes of each request
(Anchor + Residual of its final ``meta_info["lynx_transfer"]`` report) and its output
tokens. Against the baseline (the first revision's first round, prompt by prompt): the
bytes ("same": every request's bytes equal, ratio exactly 1), the outputs (how many equal
token for token) and the median ratios. ``--revision a=. --revision b=.`` runs a checkout
against itself: the host's noise alone.

Prints a markdown table, writes ``revisions.json`` (the figures, every request, where each
server imported Lynx from, each checkout's commit) and ``revisions.png`` (per
configuration the medians, revisions side by side) to ``--out``, and the servers' logs to
``--out``/logs. The run the issue asked for (SmolLM2, 2k-token prompts, 20 Mbit/s):

    sudo PYTHONPATH=python:benchmark .venv/bin/python benchmark/revisions.py \\
        --revision before=/path/to/old/checkout --revision after=. \\
        --link 20mbit --contexts 2048 --repeats 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench_texts import benchmark_parser, fetch_texts, resolved_dtype
from pd_transfer import (
    CONFIGS,
    Pair,
    add_pair_options,
    draw_medians,
    measure,
    median_of,
    prompts_from,
    rerun_on_decode_side,
)
from transformers import AutoTokenizer

from lynx.tools.cluster import SingleServer, http_json, terminate_on_sigterm

ROOT = Path(__file__).resolve().parents[1]
CODEC = "_cpu_codec*.so"
CODEC_DIR = "python/lynx/codec"
DEFAULT_CONFIGS = ["lynx-full", "lynx-speculative"]
# Run with a revision's environment: where its imports resolve, as the servers' will.
PROBE = """
import importlib, importlib.metadata, json
import lynx, lynx_patches
from lynx.codec import cpp_backend
plugins = {
    ep.value: importlib.import_module(ep.module).__file__
    for ep in importlib.metadata.entry_points(group="sglang.srt.plugins")
    if ep.module.split(".")[0] == "lynx_patches"
}
print(json.dumps({"lynx": lynx.__file__, "lynx_patches": lynx_patches.__file__,
                  "plugins": plugins, "cpp_codec": cpp_backend.available()}))
"""


@dataclass(frozen=True)
class Revision:
    """A checkout of this repo, by the name the tables give it."""

    name: str
    path: Path  # the checkout's root

    @property
    def python(self) -> Path:
        return self.path / "python"

    def env(self) -> dict[str, str]:
        """The servers' extra environment: this checkout's ``python/`` first on the path."""
        rest = os.environ.get("PYTHONPATH")
        return {"PYTHONPATH": os.pathsep.join([str(self.python), *([rest] if rest else [])])}

    def owns(self, file: str) -> bool:
        return Path(file).resolve().is_relative_to(self.python.resolve())


def parse_revision(text: str) -> Revision:
    """``NAME=PATH`` (argparse's ``type``)."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=PATH (PATH: a checkout's root)")
    return Revision(name, Path(path).expanduser().resolve())


def checkout_problem(revision: Revision) -> str | None:
    """Why ``revision`` cannot run, or None."""
    where = f"--revision {revision.name}={revision.path}"
    packages = [revision.python / p / "__init__.py" for p in ("lynx", "lynx_patches")]
    if not all(p.is_file() for p in packages):
        return f"{where}: no python/lynx and python/lynx_patches there (not a checkout of this repo)"
    if not any((revision.path / CODEC_DIR).glob(CODEC)):
        ours = sorted((ROOT / CODEC_DIR).glob(CODEC))
        copy = f"copy {ours[0]} there" if ours else "copy one there from a checkout that has it"
        return (
            f"{where}: lacks the compiled C++ codec {CODEC_DIR}/{CODEC} (untracked, so a fresh "
            f"checkout has none): {copy} (where its {CODEC_DIR}/csrc and cpp_build.py equal this "
            f"checkout's; else the stale build is refused), or build it there with "
            f"`cd {revision.path} && {sys.executable} setup.py build_ext --inplace`"
        )
    return None


def probe(revision: Revision) -> dict[str, Any]:
    """Where ``revision``'s environment imports Lynx from; exits unless it is its checkout
    and the C++ codec loads."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE],
        env={**os.environ, **revision.env()},
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"revision {revision.name}: importing Lynx failed:\n{done.stderr[-3000:]}")
    found = json.loads(done.stdout.splitlines()[-1])
    files = [found["lynx"], found["lynx_patches"], *found["plugins"].values()]
    if not found["plugins"] or not all(revision.owns(f) for f in files):
        raise SystemExit(f"revision {revision.name}: imports Lynx from outside {revision.python}: {found}")
    if not found["cpp_codec"]:
        raise SystemExit(
            f"revision {revision.name}: its C++ codec does not load (stale or not for this CPU), "
            f"the torch reference would serve, 70x slower:\n{done.stderr[-3000:]}"
        )
    return found


def commit_of(path: Path) -> str | None:
    """``path``'s commit, ``+dirty`` with uncommitted changes to tracked files."""
    git = ["git", "-c", "safe.directory=*", "-C", str(path)]
    try:
        head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
        status = subprocess.run(
            [*git, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.stdout.strip() + ("+dirty" if status.stdout.strip() else "")


def mapped_codecs(server: SingleServer) -> list[str]:
    """The C++ codec files mapped by ``server``'s processes (its session: the launcher and
    its scheduler and detokenizer subprocesses)."""
    leader = server.processes[0].process
    assert leader is not None
    found = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            # after "(comm)": state, ppid, pgrp, session, ...
            if int((proc / "stat").read_text().rsplit(")", 1)[1].split()[3]) != leader.pid:
                continue
            maps = (proc / "maps").read_text()
        except (OSError, ValueError, IndexError):
            continue  # gone, or not ours to read
        found.update(line.split(maxsplit=5)[-1] for line in maps.splitlines() if "_cpu_codec" in line)
    return sorted(found)


def check_imports(pair: Pair, revision: Revision, lynx: bool) -> dict[str, Any]:
    """Each server of ``pair`` runs ``revision``'s Lynx: the C++ codec its processes mapped
    is that checkout's, and (with ``--lynx``) is the codec that serves."""
    seen: dict[str, Any] = {}
    for side, server in pair.servers.items():
        codecs = mapped_codecs(server)
        backend = http_json(server.url + "/server_info")["internal_states"][0].get("lynx_codec_backend")
        if lynx and not codecs:
            raise SystemExit(f"revision {revision.name}: {side} mapped no C++ codec (log {server.log_paths})")
        if not all(revision.owns(c) for c in codecs):
            raise SystemExit(f"revision {revision.name}: {side} imported Lynx from elsewhere: {codecs}")
        if lynx and backend not in ("cpp", "triton"):
            raise SystemExit(f"revision {revision.name}: {side} encodes with the {backend} codec, not cpp")
        seen[side] = {"codec_files": codecs, "codec_backend": backend}
    return seen


def schedule(revisions: list[Revision], rounds: int) -> list[tuple[int, Revision]]:
    """(round, revision) in the order they run: the revisions in order, then reversed,
    alternately (two revisions, two rounds: ABBA)."""
    return [(r, rev) for r in range(rounds) for rev in (revisions if r % 2 == 0 else revisions[::-1])]


def compare(
    runs: dict[str, list[dict[str, Any]]], contexts: list[int], marks: list[int]
) -> list[dict[str, Any]]:
    """One configuration's row per revision (``runs``' first is the baseline): the medians
    and their ratios to the baseline's, and each request's bytes and output against the
    baseline's first request of the same prompt (its own other rounds included)."""
    baseline = next(iter(runs.values()))
    first = {(r["context"], r["prompt"]): r for r in baseline if r["round"] == 0}
    rows = []
    for name, mine in runs.items():
        pairs = [(r, first[r["context"], r["prompt"]]) for r in mine]
        row: dict[str, Any] = {"revision": name, "requests": len(mine)}
        row["identical_outputs"] = sum(r["output_ids"] == ref["output_ids"] for r, ref in pairs)
        sizes, ref_sizes = [r["kv_bytes"] for r, _ in pairs], [ref["kv_bytes"] for _, ref in pairs]
        if None not in sizes and None not in ref_sizes:
            row["kv_bytes_per_request"] = statistics.median(sizes)
            row["bytes_ratio"] = sum(sizes) / sum(ref_sizes)
            row["bytes_same"] = sizes == ref_sizes
        rounds = sorted({r["round"] for r in mine})
        for c in contexts:
            for n in (1, *marks):
                label = f"ttft_{c}" if n == 1 else f"t{n}_{c}"
                row[label] = median_of(mine, c, n)
                row[f"{label}_ratio"] = row[label] / median_of(baseline, c, n)
                row[f"{label}_rounds"] = [
                    median_of([r for r in mine if r["round"] == i], c, n) for i in rounds
                ]
        rows.append(row)
    return rows


def table(rows: dict[str, list[dict[str, Any]]], contexts: list[int], marks: list[int]) -> str:
    """The markdown table of :func:`compare`'s rows per configuration."""
    points = [(c, n) for c in contexts for n in (1, *marks)]
    heads = [f"{'TTFT' if n == 1 else f'token {n}'} {c}" for c, n in points]
    lines = [
        "| config | revision | KV bytes/request | bytes | outputs | " + " | ".join(heads) + " |",
        "|---|---|---:|---|---|" + "---:|" * len(points),
    ]
    for config, config_rows in rows.items():
        for i, row in enumerate(config_rows):
            if "bytes_same" in row:
                size = f"{row['kv_bytes_per_request']:,.0f}"
                same = f"{'same' if row['bytes_same'] else 'differs'} ({row['bytes_ratio']:.4f})"
            else:
                size, same = "n/a", "n/a (no Lynx report)"
            cells = []
            for c, n in points:
                label = f"ttft_{c}" if n == 1 else f"t{n}_{c}"
                cells.append(f"{row[label]:.2f} s" + ("" if i == 0 else f" ({row[f'{label}_ratio']:.2f})"))
            outputs = f"{row['identical_outputs']}/{row['requests']} identical"
            lines.append(
                f"| {config} | {row['revision']} | {size} | {same} | {outputs} | " + " | ".join(cells) + " |"
            )
    return "\n".join(lines)


def plot(
    runs: dict[str, dict[str, list[dict[str, Any]]]],
    contexts: list[int],
    marks: list[int],
    title: str,
    path: Path,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [1, *marks]
    fig, axes = plt.subplots(len(runs), len(panels), figsize=(6 * len(panels), 4 * len(runs)), squeeze=False)
    for row, (config, by_revision) in zip(axes, runs.items(), strict=True):
        times = {
            name: {
                "times": {
                    c: {n: [r["times"][n] for r in rs if r["context"] == c] for n in panels} for c in contexts
                }
            }
            for name, rs in by_revision.items()
        }
        draw_medians(row, times, contexts, marks)
        for ax in row:
            ax.set_title(config)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = benchmark_parser(__doc__)
    parser.add_argument(
        "--revision",
        dest="revisions",
        action="append",
        type=parse_revision,
        required=True,
        metavar="NAME=PATH",
        help="a checkout's root (repeat; at least two; the first is the baseline)",
    )
    add_pair_options(parser)
    parser.add_argument(
        "--rounds", type=int, default=2, help="turns per revision, alternating the order (ABBA)"
    )
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, choices=list(CONFIGS))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmark/results/revisions")
    args = parser.parse_args(argv)
    names = [r.name for r in args.revisions]
    if len(names) < 2:
        parser.error("give at least two --revision NAME=PATH (the first is the baseline)")
    if len(set(names)) < len(names):
        parser.error(f"the --revision names must differ: {names}")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    for revision in args.revisions:
        if (problem := checkout_problem(revision)) is not None:
            parser.error(problem)
    args.dtype = resolved_dtype(args.dtype)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if (status := rerun_on_decode_side(args)) is not None:
        return status
    started = time.time()
    fetch_texts(args.data)
    revisions = [
        {"name": rev.name, "path": str(rev.path), "commit": commit_of(rev.path), "imports": probe(rev)}
        for rev in args.revisions
    ]
    for rev in revisions:
        print(f"revision {rev['name']}: {rev['path']} at {rev['commit']}, Lynx from {rev['imports']['lynx']}")
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    prompts = {c: prompts_from(args.data, tokenizer, args.repeats, c, skip=1000) for c in args.contexts}
    order = schedule(args.revisions, args.rounds)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    servers: list[dict[str, Any]] = []
    with terminate_on_sigterm():
        for config in args.configs:
            runs[config] = {rev.name: [] for rev in args.revisions}
            for round_, rev in order:
                print(f"== {config}, round {round_ + 1}: {rev.name}", flush=True)
                log_dir = args.out / "logs" / config / f"{round_ + 1}-{rev.name}"
                with Pair(rev.name, CONFIGS[config], args, log_dir, env=rev.env()) as pair:
                    imports = check_imports(pair, rev, lynx="--lynx" in CONFIGS[config])
                    servers.append({"config": config, "round": round_, "revision": rev.name, **imports})
                    mine = measure(pair, prompts, args.marks, round_)
                runs[config][rev.name] += mine
                ttfts = [round(r["times"][1], 2) for r in mine]
                print(f"  TTFT {ttfts} s, KV bytes {[r['kv_bytes'] for r in mine]}", flush=True)
    rows = {config: compare(by_revision, args.contexts, args.marks) for config, by_revision in runs.items()}
    link = args.link or "loopback"
    turns = ", ".join(rev.name for _, rev in order)
    print(
        f"\n{args.model.name}, {args.dtype}, {link} link; turns per configuration: {turns}; "
        f"{args.repeats} prompt(s) per context per turn; medians, (ratio) to {args.revisions[0].name}; "
        "bytes and outputs against its first turn, prompt by prompt"
    )
    print(table(rows, args.contexts, args.marks))
    wall_s = time.time() - started
    report = {
        "command": sys.argv,
        "args": {k: str(v) for k, v in vars(args).items()},
        "revisions": revisions,
        "order": [[r, rev.name] for r, rev in order],
        "rows": rows,
        "servers": servers,
        "wall_s": wall_s,
        "raw": runs,
    }
    (args.out / "revisions.json").write_text(json.dumps(report, indent=1))
    title = f"{args.model.name}, {link} link, {args.dtype}: medians per revision"
    plot(runs, args.contexts, args.marks, title, args.out / "revisions.png")
    print(f"wrote {args.out}/revisions.json and revisions.png; wall time {wall_s / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
