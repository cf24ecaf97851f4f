"""A hostile peer on the cluster network against real prefill and decode servers (issue
46): rooms no u64 carries, replayed and offer-less metadata, a foreign ABORT. Each is
dropped or fails only its own request, and the servers serve the next requests exactly.

Servers, on the tiny model, started once for the module: ``PK``/``DK``, ``--lynx`` full
mode with the exact Residual held back ``HOLD_S`` (the window of the in-flight cases),
both signing with one ``--lynx-auth-key-file``; ``P0``/``D0``, conftest's plain pair, the
reference. Forged messages go straight to the servers' control sockets, as an attacker
who reaches them would send them.
"""

from __future__ import annotations

import secrets
import urllib.error
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import SharedServers
from pdtools import (
    PROMPTS,
    Prefill,
    batch_variant,
    decode_server,
    idle,
    in_background,
    kv_layout,
    pd_generate,
    push_control,
    state,
    wait_for,
)

from lynx.codec import CodecConfig
from lynx.mode import Mode
from lynx.tools import cluster
from lynx.tools.cluster import lynx_control_endpoint, pd_body
from lynx.transfer import Handshake, Offer, OfferBinding, RequestLayout, Stream
from lynx.transfer.auth import AuthKey
from lynx.transfer.protocol import TAG

pytestmark = pytest.mark.e2e

HOLD_S = 1.5
SHARED_SERVERS = ("P0", "D0")
U64_END = 1 << 64


@pytest.fixture(scope="module")
def key_file(log_dir: Path) -> Path:
    log_dir.mkdir(parents=True, exist_ok=True)
    path = log_dir / "lynx.key"
    path.write_text(secrets.token_hex(32))
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def servers(
    request: pytest.FixtureRequest, shared: SharedServers, tiny_model: Path, log_dir: Path, key_file: Path
) -> Iterator[dict[str, Any]]:
    config = batch_variant(tiny_model, {})
    keyed = ["--lynx", "--lynx-residual-hold", str(HOLD_S), "--lynx-auth-key-file", str(key_file)]
    own: dict[str, Any] = {
        "PK": Prefill(config, log_dir, "PK", keyed),
        "DK": decode_server(config, log_dir, "DK", keyed),
    }
    with shared.running(request, own) as group:
        yield group


@pytest.fixture(scope="module")
def reference(servers: dict) -> list[int]:
    """Plain PD's greedy answer to the prompt every test sends."""
    return pd_generate(servers["P0"], servers["D0"], PROMPTS[2])["output_ids"]


def dropped(server: Any) -> dict[str, int]:
    return state(server)["lynx_transfer"]["dropped_offers"]


def metadata(room: int | str, session: bytes, port: int, n_tokens: int) -> list[bytes]:
    """Upstream's metadata message for ``room``, as a decode at 127.0.0.1:``port`` with
    Mooncake ``session`` sends it (page ids for ``n_tokens`` tokens)."""
    return [
        str(room).encode(),
        b"127.0.0.1",
        str(port).encode(),
        session,
        b"\0" * 4 * n_tokens,
        b"0",
        b"",
        b"1",
    ]


def test_forged_rooms_replayed_and_offerless_metadata_take_nothing(
    servers: dict, tiny_model: Path, key_file: Path, reference: list[int]
) -> None:
    """Old: two metadata messages for room 2**64 ended prefill's bootstrap thread (no key
    needed); a signed offer re-sent with another session made prefill write the prompt's
    KV to the sender's engine; an offer-less message arriving first took the room, and
    the real offer was refused. Now each is dropped before it takes anything, and the
    request of the room they claimed is served exactly when its decode asks."""
    prefill, decode = servers["PK"], servers["DK"]
    assert pd_generate(prefill, decode, PROMPTS[2])["output_ids"] == reference
    before = dropped(prefill)
    key = AuthKey(key_file.read_bytes().strip())
    n_tokens = 8
    handshake = Handshake(Mode.FULL, CodecConfig(), kv_layout(tiny_model), checksums=True).signed_with(key)
    sent = RequestLayout.sent_nbytes_of(handshake, n_tokens)
    body = pd_body(PROMPTS[2], prefill.bootstrap_port)
    room = body["bootstrap_room"]
    offer = Offer(
        handshake.to_wire(), 1, 1 << 30, sent[Stream.ANCHOR], 1 << 31, sent[Stream.RESIDUAL], n_tokens
    )
    captured = offer.signed(key, OfferBinding(room, "127.0.0.1:16000", ("127.0.0.1", 2))).to_wire()
    push_control(
        lynx_control_endpoint(prefill.processes[0].log_path),
        [
            [*metadata(U64_END, b"forged:1", 2, n_tokens), TAG, offer.to_wire()],
            [*metadata(U64_END, b"forged:2", 2, n_tokens), TAG, offer.to_wire()],
            metadata(U64_END + 7, b"forged:3", 2, n_tokens),
            metadata(-1, b"forged:4", 2, n_tokens),
            [b"ABORT", str(U64_END).encode(), b"127.0.0.1", b"2"],
            [*metadata(room, b"attacker:1", 2, n_tokens), TAG, captured],  # replayed, other session
            [*metadata(room, b"127.0.0.1:16000", 3, n_tokens), TAG, captured],  # ... other endpoint
            metadata(room, b"attacker:2", 2, n_tokens),  # offer-less, first for the room
        ],
    )

    def counted() -> bool:
        now = dropped(prefill)
        return now.get("bad_signature", 0) - before.get("bad_signature", 0) == 2 and (
            now.get("unsigned", 0) - before.get("unsigned", 0) == 1
        )

    wait_for(counted, "the replayed and offer-less messages dropped")
    log = prefill.processes[0].log_path.read_text(errors="replace")
    assert "room or port is out of range" in log
    assert "replayed with another session or notice endpoint" in log
    answer = cluster.pd_generate(prefill.url, decode.url, body, 180.0)
    assert answer["output_ids"] == reference  # the room's own request, served exactly
    assert pd_generate(prefill, decode, PROMPTS[2])["output_ids"] == reference
    wait_for(lambda: idle(prefill) and idle(decode), "idle")


@pytest.mark.parametrize(
    ("room", "said"),
    [
        # Upstream's HTTP entry refuses it first (JSON's 2**64 does not parse as its int);
        # the scheduler-side entries refuse it too (test_hostile_prefill, test_mooncake_connector).
        (U64_END, "'loc': ('body', 'bootstrap_room', 'int')"),
        (-1, "Lynx: room -1 (bootstrap_room) is not an integer in 0..2**64-1"),
    ],
)
def test_a_clients_room_outside_u64_fails_that_request_alone(
    servers: dict, room: int, said: str, reference: list[int]
) -> None:
    """Old: a client's bootstrap_room of -1 raised on a scheduler thread (decode's reserve
    when keyed, prefill's sizing when not), and so did 2**64 where a client could pass it."""
    prefill, decode = servers["PK"], servers["DK"]
    body = {**pd_body(PROMPTS[2], prefill.bootstrap_port), "bootstrap_room": room}
    with pytest.raises(urllib.error.HTTPError) as failure:
        cluster.pd_generate(prefill.url, decode.url, body, 180.0)
    assert said in failure.value.read().decode(errors="replace")
    for _ in range(2):
        assert pd_generate(prefill, decode, PROMPTS[2])["output_ids"] == reference
    wait_for(lambda: idle(prefill) and idle(decode), "idle")


def test_with_a_key_an_abort_from_another_decode_stops_nothing(servers: dict, reference: list[int]) -> None:
    """Old: upstream's unsigned ABORT for a live room stopped its Lynx transfer, whoever sent it."""
    prefill, decode = servers["PK"], servers["DK"]
    before = dropped(prefill).get("foreign_abort", 0)
    body = pd_body(PROMPTS[2], prefill.bootstrap_port)
    pending = in_background(lambda: cluster.pd_generate(prefill.url, decode.url, body, 180.0))
    wait_for(lambda: state(decode)["lynx_transfer"]["rooms"] == 1, "receiving")  # the Residual is held
    abort = [b"ABORT", str(body["bootstrap_room"]).encode(), b"127.0.0.1", b"2"]
    push_control(lynx_control_endpoint(prefill.processes[0].log_path), [abort])
    wait_for(lambda: dropped(prefill).get("foreign_abort", 0) == before + 1, "the foreign ABORT dropped")
    assert pending.result(timeout=180)["output_ids"] == reference
    wait_for(lambda: idle(prefill) and idle(decode), "idle")
