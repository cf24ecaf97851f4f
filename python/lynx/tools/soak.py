"""A chaos soak of speculative mode: real prefill, decode and router servers under load
while prefill is killed and restarted, stalled past the transfer deadline, and forged
Lynx notices arrive at decode.

Clients (``--clients`` threads, for ``--duration`` seconds or until the chaos is over
and requests have been served for a while after it) send through the router a mix
of greedy, greedy streamed, sampled and aborted requests over a fixed prompt set. Every
greedy answer must equal the reference (plain BF16 PD, computed first on a separate pair:
speculative mode with an exact Residual is exact) up to a near-tie: a first difference
whose token the reference itself scores within ``NEAR_TIE_GAP`` of its best is counted
apart, with its gap (the tiny random-weight model has flat logits, and the reference ran
at other batch sizes than the soak's 64 clients, which the CPU's matrix products may round
differently); every other
request must end, either with an answer or with an error the client can read. A forger
sends notices to decode's notice endpoint the whole time: for random rooms, and for the
live rooms of requests it sends itself (wrong nonce, wrong byte count, an early
RELEASED). At the end decode's free KV tokens and Lynx's receive buffer must be back at
their idle values, and both servers must still answer.

    python -m lynx.tools.soak --model ~/.cache/lynx/models/tiny-llama-s0 --duration 180 --clients 64

Prints the figures and writes them as JSON (``--out``); exits 1 if any output was wrong,
any page leaked or any request hung.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lynx.tools.cluster import (
    HOST,
    ClusterError,
    PDCluster,
    ServerConfig,
    http_json,
    lynx_control_endpoint,
    stream_json,
)
from lynx.transfer.protocol import Notice, NoticeKind, Stream
from lynx.verify import NEAR_TIE_GAP

MAX_NEW_TOKENS = 24
DEADLINE_S = 6.0
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "wizards",
    "quietly",
    "judge",
    "boxing",
    "matches",
    "and",
    "a",
    "sphinx",
    "of",
    "black",
    "quartz",
    "hears",
    "every",
    "vow",
]


def prompts(n: int) -> list[str]:
    """``n`` distinct prompts of 60..480 words, the same on every run."""
    rng = random.Random(7)
    return [f"{i}: " + " ".join(rng.choice(WORDS) for _ in range(60 + 30 * i)) for i in range(n)]


def lynx_args(hold_s: float, auth_key_file: Path | None = None) -> tuple[list[str], list[str]]:
    """(prefill's, decode's) Lynx flags; with ``auth_key_file`` both sign their control
    messages, and decode drops the forger's unsigned notices unread."""
    common = [
        "--lynx",
        "--lynx-mode",
        "speculative",
        "--lynx-residual",
        "exact",
        "--lynx-anchor-bits",
        "4",
        "--lynx-transfer-deadline",
        str(DEADLINE_S),
        *(["--lynx-auth-key-file", str(auth_key_file)] if auth_key_file is not None else []),
    ]
    return [*common, "--lynx-residual-hold", str(hold_s)], common


def body(prompt: str, sampled: bool = False, **extra: Any) -> dict[str, Any]:
    params: dict[str, Any] = {"max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True}
    params.update({"temperature": 0.8, "top_p": 0.9} if sampled else {"temperature": 0})
    return {"text": prompt, "sampling_params": params, **extra}


TOP_LOGPROBS = 5  # per reference position: enough to find the token a near-tie flipped to


@dataclass(frozen=True)
class Reference:
    """A prompt's greedy answer on plain BF16 PD, with the best ``TOP_LOGPROBS``
    log-probabilities at each position (token -> logprob)."""

    output_ids: list[int]
    top: list[dict[int, float]]

    @classmethod
    def of(cls, answer: dict[str, Any]) -> Reference:
        rows = answer["meta_info"]["output_top_logprobs"]
        return cls(answer["output_ids"], [{int(t): float(v) for v, t, *_ in row} for row in rows])


def judge(output: list[int], ref: Reference) -> tuple[str, str | None]:
    """A greedy answer against its reference: ``("greedy equal", None)``; ``("greedy, near-tie",
    what)`` when the first differing token is within ``NEAR_TIE_GAP`` of the reference's
    best at that position (upstream's kernels break such ties differently with the shape
    of the batch: the verify pass runs k rows of one request at once); else ``("wrong",
    what)``."""
    if output == ref.output_ids:
        return "greedy equal", None
    pairs = zip(output, ref.output_ids, strict=False)
    first = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(output), len(ref.output_ids)))
    what = f"{len(output)} tokens, first difference at {first}: {output} vs {ref.output_ids}"
    if first < min(len(output), len(ref.top)):
        best = ref.top[first]
        ours = best.get(output[first])
        if ours is not None and max(best.values()) - ours < NEAR_TIE_GAP:
            return "greedy, near-tie", f"gap {max(best.values()) - ours:.4f} at {first}: {what}"
    return "wrong", what


@dataclass
class Tally:
    lock: threading.Lock = field(default_factory=threading.Lock)
    counts: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    wrong: list[str] = field(default_factory=list)  # what each wrong output was, whole
    near_ties: Counter[str] = field(default_factory=Counter)  # each near-tie difference, whole

    def failures(self) -> int:
        with self.lock:
            return self.counts["failed, clear error"] + self.counts["failed, no message"]

    def add(self, outcome: str, error: str | None = None) -> None:
        with self.lock:
            self.counts[outcome] += 1
            if error is not None:
                self.errors[error[:120]] += 1
            if outcome == "wrong":
                self.wrong.append(error or "")
            if outcome.endswith("near-tie"):
                self.near_ties[error or ""] += 1


def _post(url: str, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
    return http_json(url, payload, timeout=timeout)


def _stream(url: str, payload: dict[str, Any], timeout: float, stop_after: int | None) -> list[int]:
    output: list[int] = []
    with contextlib.closing(stream_json(url, payload, timeout)) as chunks:
        for chunk in chunks:
            if "error" in chunk:
                raise RuntimeError(json.dumps(chunk["error"]))
            output = _output_ids(chunk)
            if stop_after is not None and len(output) >= stop_after:
                break  # the client goes away: the server must abort the request
    return output


def _output_ids(answer: dict[str, Any]) -> list[int]:
    """The answer's tokens; a request the server ended early (its transfer failed, say)
    says so in its finish reason: an error the client can read, not a wrong output."""
    finish = answer.get("meta_info", {}).get("finish_reason") or {}
    if finish.get("type") == "abort":
        raise RuntimeError(f"aborted by the server: {finish.get('message')}")
    return answer["output_ids"]


def one_request(kind: str, url: str, prompt: str, reference: Reference, tally: Tally, timeout: float) -> None:
    try:
        if kind == "greedy":
            output = _output_ids(_post(url + "/generate", body(prompt), timeout))
        elif kind == "streamed":
            output = _stream(url + "/generate", body(prompt), timeout, None)
        elif kind == "sampled":
            output = _output_ids(_post(url + "/generate", body(prompt, sampled=True), timeout))
            ok = len(output) == MAX_NEW_TOKENS
            tally.add("sampled ok" if ok else "wrong", None if ok else f"sampled: {len(output)} tokens")
            return
        else:  # aborted by the client after its first tokens
            _stream(url + "/generate", body(prompt), timeout, stop_after=2)
            tally.add("aborted by client")
            return
    except TimeoutError:
        tally.add("hung", f"{kind}: no answer in {timeout:.0f} s")
        return
    except urllib.error.HTTPError as exc:
        text = exc.read().decode(errors="replace")
        tally.add("failed, clear error" if text.strip() else "failed, no message", text or str(exc))
        return
    except (urllib.error.URLError, OSError, RuntimeError) as exc:
        if "timed out" in str(exc):
            tally.add("hung", f"{kind}: {exc}")
        else:
            tally.add("failed, clear error", f"{type(exc).__name__}: {exc}")
        return
    outcome, what = judge(output, reference)
    tally.add(outcome, None if what is None else f"{kind}: {what}")


def clients(
    url: str, refs: dict[str, Reference], n: int, stop: threading.Event, tally: Tally, timeout: float
) -> None:
    kinds = ("greedy", "greedy", "greedy", "streamed", "sampled", "sampled", "aborted", "greedy")
    texts = list(refs)

    def loop(i: int) -> None:
        rng = random.Random(i)
        failing = 0
        while not stop.is_set():
            prompt = rng.choice(texts)
            failed_before = tally.failures()
            one_request(kinds[i % len(kinds)], url, prompt, refs[prompt], tally, timeout)
            failing = failing + 1 if tally.failures() > failed_before else 0
            if failing:
                # Back off (0.5 s doubling to 8 s) as a real client does while the
                # cluster is down, instead of keeping the router and the restarting
                # prefill's CPU busy with refusals.
                stop.wait(min(8.0, 0.5 * 2 ** (failing - 1)))

    with ThreadPoolExecutor(n) as pool:
        list(pool.map(loop, range(n)))


class Forger:
    """Sends forged Lynx notices to decode's notice endpoint: for random rooms, and for the
    rooms of requests it sends itself (which must still answer correctly)."""

    def __init__(self, endpoint: str, cluster: PDCluster, refs: dict[str, Reference], tally: Tally) -> None:
        import zmq  # a dependency of SGLang's, not of Lynx's core

        self._ctx = zmq.Context()
        self._socket = self._ctx.socket(zmq.PUSH)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(endpoint)
        self._cluster = cluster
        self._refs = refs
        self._tally = tally
        self.sent = 0

    def _send(self, notice: Notice) -> None:
        self._socket.send_multipart(notice.to_frames())
        self.sent += 1

    def forge(self, room: int) -> None:
        nonce = random.getrandbits(64)
        self._send(Notice(NoticeKind.LANDED, room, nonce=nonce, stream=Stream.ANCHOR, nbytes=0))
        self._send(Notice(NoticeKind.LANDED, room, nonce=nonce, stream=Stream.RESIDUAL, nbytes=1 << 40))
        self._send(Notice(NoticeKind.RELEASED, room, nonce=nonce))

    def run(self, stop: threading.Event) -> None:
        rng = random.Random(3)
        prompts_ = list(self._refs)
        while not stop.is_set():
            self.forge(rng.getrandbits(62))
            prompt = rng.choice(prompts_)
            room = rng.getrandbits(62)
            extra = {
                "bootstrap_host": HOST,
                "bootstrap_port": self._cluster.bootstrap_port,
                "bootstrap_room": room,
            }
            with ThreadPoolExecutor(2) as pool:
                to_prefill = pool.submit(
                    _quietly, self._cluster.prefill_url + "/generate", body(prompt, **extra)
                )
                answer = pool.submit(
                    _post, self._cluster.decode_url + "/generate", body(prompt, **extra), 120
                )
                for _ in range(5):  # while its transfer is in flight
                    self.forge(room)
                    time.sleep(0.05)
                try:
                    output = answer.result()["output_ids"]
                    outcome, what = judge(output, self._refs[prompt])
                    self._tally.add(outcome.replace("greedy", "forged-room"), what)
                except urllib.error.HTTPError as exc:
                    self._tally.add("forged-room failed, clear error", exc.read().decode(errors="replace"))
                except (urllib.error.URLError, OSError) as exc:
                    self._tally.add("forged-room failed, clear error", f"{type(exc).__name__}: {exc}")
                to_prefill.result()

    def close(self) -> None:
        self._socket.close()
        self._ctx.term()


def _quietly(url: str, payload: dict[str, Any]) -> None:
    with contextlib.suppress(urllib.error.URLError, OSError):
        _post(url, payload, 120)


def decode_state(cluster: PDCluster) -> dict[str, Any]:
    return http_json(cluster.decode_url + "/server_info")["internal_states"][0]


def quiet_figures(cluster: PDCluster) -> tuple[int, int]:
    """(free KV tokens, Lynx receive-buffer bytes in use) of decode."""
    state = decode_state(cluster)
    return state["lynx_kv_available_tokens"], state["lynx_transfer"]["buffer_used"]


def idle_figures(cluster: PDCluster) -> tuple[int, int]:
    """``quiet_figures`` once nothing is in flight (the router's readiness request may
    still hold its receive space for a moment)."""
    deadline = time.monotonic() + 120
    while True:
        state = decode_state(cluster)["lynx_transfer"]
        if (state["rooms"] == 0 and state["buffer_used"] == 0) or time.monotonic() > deadline:
            return quiet_figures(cluster)
        time.sleep(1.0)


def wait_quiet(cluster: PDCluster, idle: tuple[int, int], timeout_s: float) -> tuple[int, int]:
    deadline = time.monotonic() + timeout_s
    while True:
        figures = quiet_figures(cluster)
        if figures == idle or time.monotonic() > deadline:
            return figures
        time.sleep(1.0)


def still_serves(url: str, prompt: str, reference: list[int], timeout_s: float = 180.0) -> bool:
    """A greedy request through the router answers the reference, once the router has
    taken the restarted prefill back (it answers 503 until its health check does)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return _output_ids(_post(url + "/generate", body(prompt), 300)) == reference
        except (urllib.error.URLError, OSError, RuntimeError):
            if time.monotonic() > deadline:
                return False
            time.sleep(2.0)


def restart_prefill(cluster: PDCluster) -> None:
    """SIGKILL prefill (a crash), start it again on the same ports, wait until it answers."""
    prefill = cluster.processes[0]
    assert prefill.process is not None
    with contextlib.suppress(ProcessLookupError):
        os.killpg(prefill.process.pid, signal.SIGKILL)
    prefill.stop()
    prefill.start()
    deadline = time.monotonic() + 600
    while True:
        with contextlib.suppress(urllib.error.URLError, OSError):
            if urllib.request.urlopen(cluster.prefill_url + "/health", timeout=5).status == 200:
                return
        if time.monotonic() > deadline:
            raise ClusterError("prefill did not come back")
        time.sleep(1.0)


def stall_prefill(cluster: PDCluster, seconds: float) -> None:
    prefill = cluster.processes[0]
    assert prefill.process is not None
    os.killpg(prefill.process.pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        os.killpg(prefill.process.pid, signal.SIGCONT)


def chaos(
    cluster: PDCluster, start: float, duration: float, log: Callable[[str], None], stop: threading.Event
) -> None:
    """Kill and restart prefill, stall it past the deadline, kill and restart it again, at
    fixed shares of ``duration`` but never sooner than ``duration / 6`` after the previous
    act ended (a restart takes a minute or more on a loaded 2-core host, and requests must
    be served between the acts); then set ``stop`` as long after the last one."""
    plan: list[tuple[float, str, Callable[[], None]]] = [
        (0.15, "prefill killed and restarted", lambda: restart_prefill(cluster)),
        (0.45, f"prefill stalled {DEADLINE_S + 3:.0f} s", lambda: stall_prefill(cluster, DEADLINE_S + 3)),
        (0.70, "prefill killed and restarted", lambda: restart_prefill(cluster)),
    ]
    ready = start
    for at, what, act in plan:
        time.sleep(max(0.0, start + at * duration - time.monotonic(), ready - time.monotonic()))
        began = time.monotonic() - start
        act()
        log(f"{began:.0f}-{time.monotonic() - start:.0f} s: {what}")
        ready = time.monotonic() + duration / 6
    time.sleep(max(0.0, start + duration - time.monotonic(), ready - time.monotonic()))
    stop.set()


def references(config: ServerConfig, log_dir: Path, texts: list[str]) -> dict[str, Reference]:
    asked = {"return_logprob": True, "top_logprobs_num": TOP_LOGPROBS}
    with PDCluster(config, log_dir / "reference") as plain, ThreadPoolExecutor(4) as pool:
        answers = pool.map(
            lambda t: Reference.of(_post(plain.url + "/generate", body(t, **asked), 300)), texts
        )
        return dict(zip(texts, answers, strict=True))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--duration", type=float, default=180.0)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--residual-hold", type=float, default=0.4, help="s: keeps requests speculating")
    parser.add_argument("--auth-key-file", type=Path, help="--lynx-auth-key-file for both servers")
    parser.add_argument("--out", type=Path, default=Path("benchmark/results/soak"))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    config = ServerConfig(
        model_path=args.model,
        max_total_tokens=65536,  # every client's request fits: memory is not what this drills
        env={"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1"},
    )
    texts = prompts(args.prompts)
    print(f"reference outputs (plain BF16 PD) for {len(texts)} prompts ...", flush=True)
    refs = references(config, args.out / "logs", texts)
    prefill_args, decode_args = lynx_args(args.residual_hold, args.auth_key_file)
    tally = Tally()
    events: list[str] = []
    # A restarted prefill is taken back within seconds, not after the default minute the
    # router's circuit breaker stays open.
    router = ["--cb-timeout-duration-secs", "5", "--health-check-interval-secs", "2"]
    lynx = PDCluster(
        config,
        args.out / "logs" / "lynx",
        prefill_args=prefill_args,
        decode_args=decode_args,
        router_args=router,
    )
    with lynx as cluster:
        idle = idle_figures(cluster)
        forger = Forger(lynx_control_endpoint(cluster.log_dir / "decode.log"), cluster, refs, tally)
        start = time.monotonic()
        stop = threading.Event()
        timeout = 4 * DEADLINE_S + 120
        threads = [
            threading.Thread(target=chaos, args=(cluster, start, args.duration, events.append, stop)),
            threading.Thread(target=forger.run, args=(stop,)),
        ]
        for t in threads:
            t.start()
        clients(cluster.url, refs, args.clients, stop, tally, timeout)
        for t in threads:
            t.join()
        forger.close()
        final = wait_quiet(cluster, idle, timeout_s=120)
        serves = still_serves(cluster.url, texts[0], refs[texts[0]].output_ids)
        stats = decode_state(cluster)["lynx_transfer"]
    figures = {
        "requests": sum(tally.counts.values()),
        **dict(tally.counts),
        "wrong outputs": tally.counts.get("wrong", 0),
        "hung": tally.counts.get("hung", 0),
        "leaked KV tokens": idle[0] - final[0],
        "leaked receive-buffer bytes": final[1] - idle[1],
        "forged notices sent": forger.sent,
        "notices dropped by decode": stats.get("dropped_notices"),
        "both servers serve after": serves,
        "chaos": events,
        "errors seen": dict(tally.errors.most_common(12)),
        "wrong outputs, whole": tally.wrong[:10],
        "near-tie differences, whole": dict(tally.near_ties),
    }
    width = max(len(k) for k in figures)
    for key, value in figures.items():
        print(f"{key:<{width}}  {value}")
    (args.out / "soak.json").write_text(json.dumps(figures, indent=1))
    ok = (
        figures["wrong outputs"] == 0
        and figures["hung"] == 0
        and figures["leaked KV tokens"] == 0
        and figures["leaked receive-buffer bytes"] == 0
        and figures["both servers serve after"]
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
