"""Anchor latency under a Residual backlog: FIFO vs priority lanes vs an idle link.

One sender (this process, a Mooncake engine) writes to one receiving peer process. A
backlog of Residual bytes (default 16 requests x 64 MiB = 1 GiB) is submitted at t=0;
while it drains, a small Anchor (default 256 KiB) arrives every few ms. Modes, run side by
side in one process:

- idle:  the Anchors alone (no backlog): the latency to beat.
- fifo:  the backlog submitted to the engine all at once (one FIFO per peer, as without
         lanes), Anchors submitted on arrival behind it (the lanes with LOW unbounded).
- lanes: the backlog on the LOW lane (chunk size / chunks in flight per config), Anchors on
         HIGH.

Reported: Anchor completion latency (submit() to the scheduler seeing it landed) p50/p99,
as ratios to idle; Residual throughput (backlog bytes / time to drain it) and goodput
(Residual + Anchor bytes landed while it drained / that time), as ratios to fifo (under
fifo the Anchors wait until the backlog is through, under the lanes they take their share
of the link during the drain); CPU of the lanes' driver thread and of the whole sender
process, as fractions of wall time. Modes are interleaved over `--rounds` rounds. Writes
benchmark/results/lanes-LABEL-anchorNk.json and .png.

    PYTHONPATH=python python benchmark/lanes.py                   # loopback
    PYTHONPATH=python python benchmark/lanes.py --link 1gbit --backlog-mib 256

`--link RATE` builds a tbf-limited veth link between two network namespaces
(lynx.tools.netlink, needs root), reruns this script inside one with the peer in the
other, and deletes the namespaces afterwards.
"""

from __future__ import annotations

import argparse
import json
import mmap
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from lynx.lanes import Lane, LaneConfig, LaneScheduler, StreamStatus
from lynx.lanes.mooncake import MooncakeBackend
from lynx.lanes.peer import PeerProcess, buffer_address
from lynx.tools import netlink

KIB = 1024
MIB = 1024 * KIB
ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmark" / "results"
ANCHOR_SLOTS = 64


# FIFO is the lanes with LOW unbounded: the whole backlog goes to the engine at once, and
# Anchors queue behind it, as without lanes; same driver and polling as the lanes modes.
UNBOUNDED = 1 << 40


@dataclass(frozen=True)
class Mode:
    name: str
    backlog: bool
    chunk_bytes: int = UNBOUNDED
    inflight: int = UNBOUNDED
    chunk_s: float | None = None  # paced: chunk = this much link time (LaneConfig.low_chunk_s)


@dataclass
class Round:
    """One run of one mode."""

    anchor_latencies_ms: list[float]
    backlog_gbps: float | None  # Residual bytes / drain time, GB/s (1e9 bytes)
    goodput_gbps: float | None  # (Residual + Anchor bytes landed while draining) / drain time
    driver_cpu: float  # driver thread CPU seconds / wall seconds
    process_cpu: float  # sender process CPU seconds / wall seconds (engine threads too)


@dataclass
class Outcome:
    """A mode over all rounds: Anchor latencies pooled, medians of the rest."""

    mode: str
    chunk_kib: int | None
    chunk_ms: float | None
    inflight: int | None
    anchors: int
    anchor_p50_ms: float
    anchor_p99_ms: float
    anchor_max_ms: float
    backlog_gbps: float | None
    goodput_gbps: float | None
    driver_cpu: float
    process_cpu: float
    rounds: list[Round]

    @classmethod
    def of(cls, mode: Mode, rounds: list[Round]) -> Outcome:
        lat = sorted(x for r in rounds for x in r.anchor_latencies_ms)
        tput = [r.backlog_gbps for r in rounds if r.backlog_gbps is not None]
        goodput = [r.goodput_gbps for r in rounds if r.goodput_gbps is not None]
        return cls(
            mode=mode.name,
            chunk_kib=mode.chunk_bytes // KIB if mode.chunk_bytes < UNBOUNDED else None,
            chunk_ms=mode.chunk_s * 1e3 if mode.chunk_s is not None else None,
            inflight=mode.inflight if mode.inflight < UNBOUNDED else None,
            anchors=len(lat),
            anchor_p50_ms=statistics.median(lat),
            anchor_p99_ms=lat[round(0.99 * (len(lat) - 1))],
            anchor_max_ms=lat[-1],
            backlog_gbps=statistics.median(tput) if tput else None,
            goodput_gbps=statistics.median(goodput) if goodput else None,
            driver_cpu=statistics.median(r.driver_cpu for r in rounds),
            process_cpu=statistics.median(r.process_cpu for r in rounds),
            rounds=rounds,
        )


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.backend = MooncakeBackend(args.sender_host)
        self.request_bytes = args.request_mib * MIB
        self.anchor_bytes = args.anchor_kib * KIB
        size = self.request_bytes + ANCHOR_SLOTS * self.anchor_bytes
        self.source = mmap.mmap(-1, size)
        self.source.write(b"\x5a" * size)  # materialise the pages
        self.src = buffer_address(self.source)
        self.size = size
        prefix = ["ip", "netns", "exec", args.peer_netns] if args.peer_netns else []
        self.peer = PeerProcess(args.peer_host, size, prefix=prefix)
        self.anchor_dst = self.peer.base + self.request_bytes
        self.anchor_src = self.src + self.request_bytes

    def close(self) -> None:
        self.peer.close()

    def run(self, mode: Mode) -> Round:
        done: dict[str, float] = {}
        n_backlog = self.args.backlog_mib * MIB // self.request_bytes if mode.backlog else 0
        backlog_settled = [0]
        drained = threading.Event()

        def settled(status: StreamStatus) -> None:
            done[status.request_id] = time.perf_counter()
            if status.request_id.startswith("backlog") and status.lane is Lane.LOW:
                backlog_settled[0] += 1
                if backlog_settled[0] == n_backlog:
                    drained.set()

        config = LaneConfig(
            low_chunk_s=mode.chunk_s,
            low_chunk_bytes=mode.chunk_bytes if mode.chunk_s is None else MIB,
            low_inflight=mode.inflight,
            deadline_s=600,
            poll_max_s=self.args.poll_max_us * 1e-6,
            poll_high_s=self.args.poll_high_us * 1e-6,
        )
        cpu0, wall0 = time.process_time(), time.perf_counter()
        lanes = LaneScheduler(self.backend, config, on_settled=settled)
        lanes.register_source(self.src, self.size)
        self._send(lanes, "warm-up", Lane.LOW, self.src, self.peer.base, self.size)
        lanes.wait("warm-up", Lane.LOW, timeout=120)
        started = time.perf_counter()
        for i in range(n_backlog):
            rid = f"backlog-{i}"
            self._send(lanes, rid, Lane.LOW, self.src, self.peer.base, self.request_bytes)
        submitted: dict[str, float] = {}
        interval = self.args.anchor_every_ms / 1000
        i = 0
        # Anchors keep arriving while the backlog drains (or `rounds` of them on an idle link).
        while not drained.is_set() if mode.backlog else i < self.args.idle_anchors:
            time.sleep(interval)
            rid = f"anchor-{i}"
            slot = (i % ANCHOR_SLOTS) * self.anchor_bytes
            submitted[rid] = time.perf_counter()
            self._send(
                lanes,
                rid,
                Lane.HIGH,
                self.anchor_src + slot,
                self.anchor_dst + slot,
                self.anchor_bytes,
            )
            i += 1
        for rid in submitted:
            lanes.wait(rid, Lane.HIGH, timeout=600)
        for j in range(n_backlog):
            lanes.wait(f"backlog-{j}", Lane.LOW, timeout=600)
        drained_at = max((done[f"backlog-{j}"] for j in range(n_backlog)), default=started)
        lanes.unregister_source(self.src)  # the next mode's scheduler registers it again
        assert lanes.close()
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        driver = lanes.stats().driver_cpu_s
        drain_s = drained_at - started
        backlog = n_backlog * self.request_bytes
        anchors_in_drain = sum(done[rid] <= drained_at for rid in submitted) * self.anchor_bytes
        return Round(
            anchor_latencies_ms=[1000 * (done[rid] - t) for rid, t in submitted.items()],
            backlog_gbps=backlog / drain_s / 1e9 if n_backlog else None,
            goodput_gbps=(backlog + anchors_in_drain) / drain_s / 1e9 if n_backlog else None,
            driver_cpu=driver / wall,
            process_cpu=cpu / wall,
        )

    def _send(self, lanes: LaneScheduler, rid: str, lane: Lane, src: int, dst: int, nbytes: int) -> None:
        other = Lane.LOW if lane is Lane.HIGH else Lane.HIGH
        lanes.register_destination(rid, self.peer.session, [(dst, nbytes)])
        lanes.submit(rid, other, [], last=True)
        lanes.submit(rid, lane, [(src, dst, nbytes)], last=True)


def modes(args: argparse.Namespace) -> list[Mode]:
    out = [Mode("idle", backlog=False), Mode("fifo", backlog=True)]
    for spec in args.configs.split(","):
        chunk, inflight = spec.split("x")
        name = f"lanes {chunk}x{inflight}"
        if chunk.endswith("ms"):
            out.append(Mode(name, True, inflight=int(inflight), chunk_s=float(chunk[:-2]) / 1e3))
        else:
            out.append(Mode(name, True, parse_size(chunk), int(inflight)))
    return out


def parse_size(text: str) -> int:
    units = {"k": KIB, "m": MIB}
    return int(float(text[:-1]) * units[text[-1].lower()]) if text[-1].isalpha() else int(text)


def table(results: list[Outcome]) -> str:
    idle = next(r for r in results if r.mode == "idle")
    idle_p50, idle_p99 = idle.anchor_p50_ms, idle.anchor_p99_ms
    fifo = next(r for r in results if r.mode == "fifo")
    rows = [
        "| mode | anchors | p50 ms | p99 ms | p50/idle | p99/idle | Residual GB/s "
        "| vs fifo | goodput vs fifo | driver CPU | process CPU |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        tput = vs = good = "-"
        if r.backlog_gbps and r.goodput_gbps and fifo.backlog_gbps and fifo.goodput_gbps:
            tput = f"{r.backlog_gbps:.3f}"
            vs = f"{r.backlog_gbps / fifo.backlog_gbps:.2f}"
            good = f"{r.goodput_gbps / fifo.goodput_gbps:.2f}"
        rows.append(
            f"| {r.mode} | {r.anchors} | {r.anchor_p50_ms:.2f} | {r.anchor_p99_ms:.2f} "
            f"| {r.anchor_p50_ms / idle_p50:.2f} | {r.anchor_p99_ms / idle_p99:.2f} | {tput} "
            f"| {vs} | {good} | {100 * r.driver_cpu:.1f}% | {100 * r.process_cpu:.0f}% |"
        )
    return "\n".join(rows)


def plot(results: list[Outcome], title: str, path: Path) -> None:
    import matplotlib  # heavy: only for the figure

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [r.mode for r in results]
    xs = range(len(results))
    ax1.bar([x - 0.2 for x in xs], [r.anchor_p50_ms for r in results], 0.4, label="p50")
    ax1.bar([x + 0.2 for x in xs], [r.anchor_p99_ms for r in results], 0.4, label="p99")
    ax1.set_yscale("log")
    ax1.set_ylabel("Anchor completion latency (ms, log)")
    ax1.set_xticks(list(xs), names, rotation=30, ha="right")
    ax1.legend()
    with_backlog = [r for r in results if r.backlog_gbps]
    xs2 = range(len(with_backlog))
    ax2.bar([x - 0.2 for x in xs2], [r.backlog_gbps or 0 for r in with_backlog], 0.4, label="Residual")
    ax2.bar(
        [x + 0.2 for x in xs2],
        [r.goodput_gbps or 0 for r in with_backlog],
        0.4,
        label="Residual + Anchors landed while draining",
    )
    ax2.set_ylabel("throughput during the drain (GB/s)")
    ax2.set_xticks(list(xs2), [r.mode for r in with_backlog], rotation=30, ha="right")
    ax2.legend(loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_inside_link(args: argparse.Namespace) -> int:
    """Build the shaped link, rerun this script on its prefill side (the sender), with the
    peer on the decode side, tear down."""
    argv = [a for a in sys.argv[1:] if a not in ("--link", args.link)]
    sender, peer = netlink.PREFILL, netlink.DECODE
    cmd = [sys.executable, __file__, *argv, "--sender-host", sender.address, "--peer-host", peer.address]
    cmd += ["--peer-netns", peer.netns, "--label", f"tbf-{args.link}"]
    return netlink.run_on_side(sender, args.link, cmd)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backlog-mib", type=int, default=1024)
    parser.add_argument("--request-mib", type=int, default=64)
    parser.add_argument("--anchor-kib", type=int, default=256)
    parser.add_argument("--anchor-every-ms", type=float, default=20)
    parser.add_argument("--idle-anchors", type=int, default=50, help="per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--configs",
        default="2msx2,1mx2,4mx2,256kx2",
        help="LOW chunk (bytes, or ms of link time: paced) x chunks in flight",
    )
    parser.add_argument("--poll-max-us", type=float, default=LaneConfig.poll_max_s * 1e6)
    parser.add_argument("--poll-high-us", type=float, default=LaneConfig.poll_high_s * 1e6)
    parser.add_argument("--link", help="tbf rate (e.g. 1gbit): run over a shaped netns link")
    parser.add_argument("--sender-host", default="127.0.0.1")
    parser.add_argument("--peer-host", default="127.0.0.1")
    parser.add_argument("--peer-netns")
    parser.add_argument("--label", default="loopback")
    args = parser.parse_args()
    if args.link:
        if (reason := netlink.unusable()) is not None:
            parser.error(f"--link {reason}")
        sys.exit(run_inside_link(args))

    bench = Bench(args)
    runs: dict[Mode, list[Round]] = {mode: [] for mode in modes(args)}
    try:
        for n in range(args.rounds):  # interleaved, so every mode sees the same load drift
            for mode, rounds in runs.items():
                rounds.append(bench.run(mode))
                lat = sorted(rounds[-1].anchor_latencies_ms)
                print(
                    f"round {n} {mode.name:>14}: p50 {statistics.median(lat):8.2f} ms  "
                    f"max {lat[-1]:8.2f} ms  backlog {rounds[-1].backlog_gbps or 0:.2f} GB/s",
                    flush=True,
                )
    finally:
        bench.close()
    results = [Outcome.of(mode, rounds) for mode, rounds in runs.items()]
    title = (
        f"lanes, {args.label}: {args.anchor_kib} KiB Anchors every {args.anchor_every_ms:g} ms "
        f"during a {args.backlog_mib} MiB Residual backlog, {args.rounds} rounds"
    )
    print(f"\n{title}\n\n{table(results)}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = RESULTS / f"lanes-{args.label}-anchor{args.anchor_kib}k"
    record = {"title": title, "args": vars(args), "results": [asdict(r) for r in results]}
    stem.with_suffix(".json").write_text(json.dumps(record, indent=1))
    plot(results, title, stem.with_suffix(".png"))
    print(f"\nwrote {stem}.json and {stem}.png")


if __name__ == "__main__":
    main()
