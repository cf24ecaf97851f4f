"""Lynx settings: one record, validated once, carried to every server process.

The launcher parses ``--lynx*`` flags into :class:`LynxSettings`; SGLang's scheduler and
detokenizer run in spawned subprocesses that rebuild ``ServerArgs`` from dataclass
fields only, so the settings travel in the environment variable :data:`SETTINGS_ENV`
(JSON), which subprocesses inherit. The auth key travels as the path of its file only
(:meth:`LynxSettings.auth_key` reads it in each process): the settings' JSON is in every
subprocess's environment and in the log.  The bytes a peer must agree on are the codec's
handshake (:meth:`lynx.codec.CodecConfig.to_wire`, from :meth:`LynxSettings.codec_config`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass

from lynx.codec import CodecConfig, CodecInputError
from lynx.codec.format import KeyLayout
from lynx.codec.format import Residual as ResidualMode
from lynx.lanes.streams import MAX_DEADLINE_S, LaneConfig
from lynx.mode import Mode
from lynx.transfer.auth import AuthKey
from lynx.verify.window import VERIFY_PASSES, VerifyPass

SETTINGS_ENV = "LYNX_SETTINGS"
AUTH_KEY_ENV = "LYNX_AUTH_KEY_FILE"
"""Where ``--lynx-auth-key-file`` is read from when the flag is not given."""

PD_MODES = ("prefill", "decode")
# "mooncake_tcp" is upstream's spelling for Mooncake with the TCP transport forced.
TRANSFER_BACKENDS = ("mooncake", "mooncake_tcp")


class LynxSettingsError(ValueError):
    """A Lynx setting, or its combination with the server's own settings, is invalid."""


CODEC_FIELDS = ("anchor_bits", "group_size", "residual", "key_layout", "key_block")
_CODEC_DEFAULTS = CodecConfig()
# Protected tokens are meant to be a few sinks and a recent window; more than this is a
# typo, and would move most of a long prompt's Residual onto the Anchor lane.
_MAX_PROTECTED = 1 << 16
# A deadline below this fails every transfer before its first write could land: a typo
# (e.g. milliseconds for seconds), not a setting.
_MIN_DEADLINE_S = 0.1
# Buffers and budgets in bytes: more than any host holds; above it a number is a typo (and
# 99999999999G reached torch.empty, whose error named no flag).
_MAX_BYTES = 1 << 40
# The lanes never cut a Residual chunk larger than this once they measured the link; a
# larger first chunk would only hold up the Anchors queued behind it.
_MAX_LANE_CHUNK = LaneConfig().low_chunk_max_bytes
# Held tokens are verified one decode step each; a window of thousands is a typo, and
# would keep a request's tokens unconfirmed for as many steps.
_MAX_SPECULATIVE_TOKENS = 1024
# An HMAC key shorter than this is guessable; a key file longer than the largest is not one.
_MIN_KEY_BYTES = 16
_MAX_KEY_BYTES = 4096
_MAX_KEY_FILE_BYTES = 2 * _MAX_KEY_BYTES  # the key and its surrounding whitespace
# What each kind of setting must be, by the type of its default (bool before int: a bool
# is an int to isinstance); a number may be written as an integer.
_KINDS: dict[type, tuple[str, tuple[type, ...]]] = {
    bool: ("true or false", (bool,)),
    int: ("an integer", (int,)),
    float: ("a number", (int, float)),
    str: ("text", (str,)),
}


@dataclass(frozen=True)
class LynxSettings:
    """What ``--lynx`` and the ``--lynx-*`` flags ask for.

    ``mode`` is a :class:`lynx.mode.Mode` (given by name, e.g. from JSON).  The codec
    fields are :class:`lynx.codec.CodecConfig`'s, validated there.
    """

    mode: Mode = Mode.FULL
    anchor_bits: int = _CODEC_DEFAULTS.anchor_bits
    group_size: int = _CODEC_DEFAULTS.group_size
    residual: ResidualMode = _CODEC_DEFAULTS.residual
    key_layout: KeyLayout = _CODEC_DEFAULTS.key_layout
    key_block: int = _CODEC_DEFAULTS.key_block
    # The first / last prompt tokens of each request travel at full precision with the
    # Anchor (attention sinks, the recent window). Paired: part of the handshake.
    protect_first: int = 0
    protect_last: int = 0
    # Prefill checksums each segment it sends, decode checks them before decoding (see
    # lynx.transfer.protocol). About 6% of encode time on the CPU, ~9 ms for a 4k-token
    # request against seconds of link time (docs/transfer.md, "Integrity of what
    # landed"), so on unless switched off. Paired: part of the handshake.
    checksums: bool = True
    max_speculative_tokens: int = 32
    # Device memory the draft distributions of sampled held tokens may take together
    # (one vocabulary-sized float32 row per token, outside SGLang's memory budget); a
    # sampled request that would exceed it parks and waits for its Residual.
    draft_memory_bytes: int = 256 << 20
    # Greedy verification accepts a held token whose full-precision log-probability is
    # within this gap of the best one (0: strict argmax, exact). Decode only, not paired.
    verify_tolerance: float = 0.0
    # How the verify pass runs the held rows (decode only, not paired): "steps", one
    # decode forward per held position, each row computed by the kernels of the decode
    # step that would have produced it (its logits and KV bit for bit, whatever the
    # kernels; about one decode step per held token); "layers", the same calls, but a
    # parked request's rows run through each layer as its Residual lands (layer by layer,
    # every row through a layer before the next), so that little is left once it all
    # did (TP 1 and the models lynx_patches.upstream.layerwise_unsupported knows; else
    # "steps"); or "batched", every held row in ONE
    # forward (~3 decode steps on the CPU backend; its products and attention round
    # differently from a decode step's unless the kernels are batch-invariant, so in BF16
    # a near-tie can break the other way: opt-in).
    verify_pass: VerifyPass = "layers"
    lane_chunk_bytes: int = 1 << 20
    transfer_deadline_s: float = 60.0
    buffer_bytes: int = 0  # 0: enough for every row of the KV pool in flight at once
    # Hold every Anchor / Residual write this long before sending it (a chunk's Residual
    # layer l of L: l / L of it, as a slow link would land them): a slower link on demand,
    # for tests, demos and fault drills. 0 in production.
    anchor_hold_s: float = 0.0
    residual_hold_s: float = 0.0
    # Prefill, not paired (the bytes on the wire are the same): a request of at least this
    # many tokens sends each chunk's Anchor layer by layer while the chunk computes (0:
    # never; each chunk's once it is computed). 2048: from there it cost <= 1.02x of chunk by
    # chunk's TTFT on an unshaped link, and 256-token prompts 1.07x (SmolLM2, CPU), while at
    # 20 Mbit/s it cut a 2k prompt's TTFT from 0.48x to 0.28x plain PD's (docs/benchmarks.md).
    layerwise_from: int = 2048
    # A file holding the key both servers sign their Lynx messages with ("": none). Paired:
    # its id is part of the handshake.
    auth_key_file: str = ""

    def __post_init__(self) -> None:
        self._check_types()
        try:
            object.__setattr__(self, "mode", Mode.parse(self.mode))  # frozen; JSON gives the name
        except ValueError as exc:
            raise LynxSettingsError(str(exc)) from None
        try:
            self.codec_config()
        except CodecInputError as exc:
            field, _, rest = str(exc).partition(" ")
            raise LynxSettingsError(f"{flag_of(field) if field in CODEC_FIELDS else field} {rest}") from None
        for protect in ("protect_first", "protect_last"):
            value = getattr(self, protect)
            if not 0 <= value <= _MAX_PROTECTED:
                raise LynxSettingsError(
                    f"{flag_of(protect)} must be a token count in 0..{_MAX_PROTECTED}, got {value}"
                )
        if not 1 <= self.max_speculative_tokens <= _MAX_SPECULATIVE_TOKENS:
            raise LynxSettingsError(
                f"--lynx-max-speculative-tokens must be in 1..{_MAX_SPECULATIVE_TOKENS}, "
                f"got {self.max_speculative_tokens}"
            )
        if self.verify_pass not in VERIFY_PASSES:
            raise LynxSettingsError(
                f"--lynx-verify-pass must be one of {', '.join(VERIFY_PASSES)}, got {self.verify_pass!r}"
            )
        if not 0.0 <= self.verify_tolerance <= 1.0:
            raise LynxSettingsError(
                "--lynx-verify-tolerance must be a log-probability gap in [0, 1], "
                f"got {self.verify_tolerance}"
            )
        if not 4096 <= self.lane_chunk_bytes <= _MAX_LANE_CHUNK:
            raise LynxSettingsError(
                f"--lynx-lane-chunk-bytes must be in 4096..{_MAX_LANE_CHUNK} bytes, "
                f"got {self.lane_chunk_bytes}"
            )
        deadline = self.transfer_deadline_s
        if not (math.isfinite(deadline) and _MIN_DEADLINE_S <= deadline <= MAX_DEADLINE_S):
            raise LynxSettingsError(
                f"--lynx-transfer-deadline must be in [{_MIN_DEADLINE_S:g}, {MAX_DEADLINE_S:g}] seconds, "
                f"got {deadline}"
            )
        for hold in ("anchor_hold_s", "residual_hold_s"):
            value = getattr(self, hold)
            if not 0 <= value < self.transfer_deadline_s:
                raise LynxSettingsError(
                    f"{flag_of(hold)} must be >= 0 and below --lynx-transfer-deadline, got {value}"
                )
        if not 0 <= self.layerwise_from <= _MAX_PROTECTED:
            raise LynxSettingsError(
                f"--lynx-layerwise-from must be a token count in 0..{_MAX_PROTECTED} (0: off), "
                f"got {self.layerwise_from}"
            )
        for nbytes in ("draft_memory_bytes", "buffer_bytes"):
            value = getattr(self, nbytes)
            if not 0 <= value <= _MAX_BYTES:
                raise LynxSettingsError(
                    f"{flag_of(nbytes)} must be in 0..{_MAX_BYTES} bytes (1TiB), got {value}"
                )

    def _check_types(self) -> None:
        """Each field is of its default's kind: JSON (``from_json``) carries any value, and
        a wrong kind would fail later with an error naming no flag, or pass (1.5 tokens)."""
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            what, allowed = next(kind for cls, kind in _KINDS.items() if isinstance(field.default, cls))
            if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
                raise LynxSettingsError(f"{flag_of(field.name)} must be {what}, got {value!r}")

    def auth_key(self) -> AuthKey | None:
        """The key in :attr:`auth_key_file` (None without one), its surrounding whitespace
        (a trailing newline) not part of it. LynxSettingsError naming the flag for a file
        that cannot be read, is not a regular file (a FIFO is refused without waiting for a
        writer), is over 8,192 bytes, holds fewer than 16 or more than 4096 bytes besides
        that whitespace, or that users other than its owner and group may read or write."""
        path = self.auth_key_file
        if not path:
            return None
        where = f"{flag_of('auth_key_file')} {path}"
        try:
            # O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer, and
            # the launcher with it, before the regular-file check below could refuse it.
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
            with os.fdopen(fd, "rb") as file:
                mode = os.fstat(file.fileno()).st_mode
                if not stat.S_ISREG(mode):
                    raise LynxSettingsError(f"{where}: not a regular file")
                # Read past the largest key and its whitespace, so that a longer file is
                # refused whole instead of cut at the limit.
                content = file.read(_MAX_KEY_FILE_BYTES + 1)
        except OSError as exc:
            raise LynxSettingsError(f"{where}: cannot read it ({exc.strerror})") from None
        if len(content) > _MAX_KEY_FILE_BYTES:
            raise LynxSettingsError(
                f"{where}: the file is over {_MAX_KEY_FILE_BYTES} bytes; a key is "
                f"{_MIN_KEY_BYTES}..{_MAX_KEY_BYTES} bytes"
            )
        if mode & 0o007:
            raise LynxSettingsError(
                f"{where}: other users may read or write it (mode {stat.S_IMODE(mode):o}); chmod o-rwx {path}"
            )
        secret = content.strip()
        if not _MIN_KEY_BYTES <= len(secret) <= _MAX_KEY_BYTES:
            raise LynxSettingsError(
                f"{where}: a key is {_MIN_KEY_BYTES}..{_MAX_KEY_BYTES} bytes, the file holds "
                f"{len(secret)} (not counting surrounding whitespace); e.g. head -c 32 /dev/urandom > {path}"
            )
        return AuthKey(secret)

    def codec_config(self) -> CodecConfig:
        return CodecConfig(**{field: getattr(self, field) for field in CODEC_FIELDS})

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> LynxSettings:
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise LynxSettingsError(f"${SETTINGS_ENV} is not valid JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise LynxSettingsError(f"${SETTINGS_ENV} must hold a JSON object, got {text!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise LynxSettingsError(f"${SETTINGS_ENV} has unknown settings {unknown}")
        return cls(**raw)


def flag_of(field: str) -> str:
    """The launcher flag of a :class:`LynxSettings` field (``key_block`` -> ``--lynx-key-block``)."""
    return "--lynx-" + field.removesuffix("_s").replace("_", "-")


_SIZE_UNITS = {
    "": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gib": 1 << 30,
}


_SWITCH = {"on": True, "true": True, "1": True, "off": False, "false": False, "0": False}


def parse_switch(text: str) -> bool:
    """``on``/``off`` (or true/false, 1/0) -> bool."""
    try:
        return _SWITCH[text.strip().lower()]
    except KeyError:
        raise ValueError(f"not on or off: {text!r}") from None


def parse_size(text: str) -> int:
    """``"1MiB"`` -> 1048576; plain integers are bytes; K/M/G are binary units."""
    match = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 65536, 512KiB, 1MiB)")
    return int(match.group(1)) * _SIZE_UNITS[unit]


def check_server_compatibility(
    settings: LynxSettings,
    *,
    disaggregation_mode: str,
    transfer_backend: str,
    attn_dp_size: int = 1,
    speculative_algorithm: str | None = None,
    decode_radix_cache: bool = False,
    kv_checksum: bool = False,
) -> None:
    """Refuse server settings Lynx cannot run under, with the flag to change."""
    if kv_checksum:
        # Upstream hashes prefill's KV and compares it with decode's; Lynx's decoded KV is
        # the Anchor's (or INT8's) reconstruction, so the hashes could never match.
        raise LynxSettingsError(
            "--disaggregation-enable-kv-checksum compares prefill's KV with decode's bit for bit, "
            "which Lynx's quantized transfer never reproduces; drop it: Lynx checks every "
            "landed segment with its own checksum (docs/transfer.md)"
        )
    if disaggregation_mode not in PD_MODES:
        raise LynxSettingsError(
            "--lynx needs a prefill/decode disaggregated server: pass "
            f"--disaggregation-mode prefill or decode (got {disaggregation_mode!r})"
        )
    verifies_here = settings.mode.verifies and disaggregation_mode == "decode"
    if verifies_here and speculative_algorithm not in (None, "", "NONE"):
        # Both would hold and verify tokens in the same decode loop, each rolling back KV
        # the other one counts on.
        raise LynxSettingsError(
            f"--lynx-mode speculative cannot run with --speculative-algorithm {speculative_algorithm} "
            "on the decode server: use one or the other"
        )
    if verifies_here and decode_radix_cache:
        # The radix cache would share Anchor-precision KV with other requests (and move a
        # request's row) before its Residual refined it.
        raise LynxSettingsError(
            "--lynx-mode speculative cannot run with --disaggregation-decode-enable-radix-cache "
            "on the decode server: it would publish unverified Anchor-precision KV to other requests"
        )
    if verifies_here and attn_dp_size > 1:
        # Data-parallel attention runs a forward on every DP rank together (idle ones
        # included), which the verify pass, run by one DP rank for its own requests, is not.
        raise LynxSettingsError(
            "--lynx-mode speculative cannot run with data-parallel attention (--attn-dp-size / "
            "--enable-dp-attention) on the decode server: use tensor parallelism (--tp-size) only"
        )
    if transfer_backend not in TRANSFER_BACKENDS:
        raise LynxSettingsError(
            "--lynx transfers KV over the Mooncake Transfer Engine: pass "
            f"--disaggregation-transfer-backend mooncake or mooncake_tcp (got {transfer_backend!r})"
        )


def publish(settings: LynxSettings | None, environ: dict[str, str] | None = None) -> None:
    """Make ``settings`` (or their absence) what every subprocess of this server sees."""
    env = os.environ if environ is None else environ
    if settings is None:
        env.pop(SETTINGS_ENV, None)
    else:
        env[SETTINGS_ENV] = settings.to_json()


_parsed: tuple[str, LynxSettings] | None = None  # the JSON last parsed, and its settings


def current(environ: Mapping[str, str] | None = None) -> LynxSettings | None:
    """The settings of this server process, or None when Lynx is off. The JSON is parsed
    and validated once per value: hooks call this on hot paths, and every caller of a
    process gets the one frozen object (:func:`publish` of other settings is read anew)."""
    global _parsed
    text = (os.environ if environ is None else environ).get(SETTINGS_ENV)
    if text is None:
        return None
    parsed = _parsed
    if parsed is None or parsed[0] != text:
        parsed = _parsed = (text, LynxSettings.from_json(text))
    return parsed[1]


def layerwise(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this server sends Anchors layer by layer (``--lynx-layerwise-from`` > 0)."""
    settings = current(environ)
    return settings is not None and settings.layerwise_from > 0
