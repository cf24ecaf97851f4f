"""``--lynx`` and ``--lynx-*`` on SGLang's launcher, and CPU-engine defaults for PD.

Hook targets (``sglang.srt.`` omitted):
* ``server_args.ServerArgs.add_cli_args`` AFTER: add the Lynx argument group.
* ``server_args.ServerArgs.from_cli_args`` AROUND: build and validate
  :class:`lynx.settings.LynxSettings`, refuse bad combinations at start-up, and publish
  the settings to the environment the scheduler subprocesses inherit (``from_cli_args``
  keeps only ``ServerArgs`` fields, so they cannot ride on ``ServerArgs``).
  On the CPU engine it also fills two PD defaults upstream gets wrong there: the decode
  retraction backup (``host_pool`` calls ``cudaHostRegister``; ``cpu_tensor`` works) and
  ``SGLANG_HOST_IP`` (Mooncake otherwise binds the NIC address, not the loopback the
  server listens on).
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import socket
from collections.abc import Callable
from typing import Any

from lynx import settings
from lynx.settings import LynxSettings, LynxSettingsError
from lynx_patches._hooks import hook, is_cpu_engine

logger = logging.getLogger(__name__)

ADD_CLI_ARGS = "server_args.ServerArgs.add_cli_args"
FROM_CLI_ARGS = "server_args.ServerArgs.from_cli_args"

_DEFAULTS = LynxSettings()
# LynxSettings field -> (type, help). Parser defaults are None so that a --lynx-* flag
# given without --lynx can be told apart from an untouched default.
_OPTIONS: dict[str, tuple[Callable[[str], Any], str]] = {
    "mode": (str, "When decode starts: full (after Anchor+Residual), anchor-only, speculative."),
    "anchor_bits": (int, "Upper bits of each INT8 code sent in the Anchor (2..4)."),
    "group_size": (int, "Values per quantization group of one token (power of two dividing head_dim)."),
    "residual": (
        str,
        "Residual: exact (default: lossless, Anchor+Residual = the KV bit for bit, ~0.75x BF16 bytes) "
        "or int8 (INT8 resolution, 0.59x; outputs may differ from plain PD's).",
    ),
    "key_layout": (str, "Key groups: per_channel (over key-block tokens) or per_token."),
    "key_block": (int, "Tokens per per-channel key group."),
    "protect_first": (
        int,
        "First prompt tokens sent at full precision with the Anchor (rounded up to a key-block multiple).",
    ),
    "protect_last": (
        int,
        "Last prompt tokens sent at full precision with the Anchor (start rounded down to a "
        "key-block multiple).",
    ),
    "checksums": (
        settings.parse_switch,
        "on/off: prefill checksums every segment it sends, decode checks it before decoding "
        "(both sides must agree).",
    ),
    "max_speculative_tokens": (int, "Most tokens a request may hold back before its Residual lands."),
    "draft_memory_bytes": (
        settings.parse_size,
        "Decode: device memory for the draft distributions of sampled held tokens, all requests "
        "together (e.g. 256MiB); a sampled request that would exceed it waits for its Residual.",
    ),
    "verify_tolerance": (
        float,
        "Greedy verification accepts a held token within this log-probability gap of the best "
        "(0: strict argmax, exact; opt-in relaxation, see docs/speculative.md).",
    ),
    "verify_pass": (
        str,
        "Decode: how the verify pass runs the held tokens: layers (as steps, but a parked "
        "request's rows run through each layer as its Residual lands; where the model or TP "
        "does not allow it, steps), steps (one decode forward per held position once the "
        "Residual landed, the decode path's logits and KV bit for bit) or batched (all in one "
        "forward, ~3 decode steps; equal to rounding unless the kernels are batch-invariant: "
        "opt-in).",
    ),
    "lane_chunk_bytes": (settings.parse_size, "Residual chunk size on the low-priority lane (e.g. 1MiB)."),
    "transfer_deadline_s": (float, "Seconds a request's KV transfer may take before it fails."),
    "buffer_bytes": (
        settings.parse_size,
        "Lynx send (prefill) / receive (decode) buffer; requests wait when it is full. "
        "0: room for every KV pool row at once.",
    ),
    "anchor_hold_s": (float, "Prefill: hold each Anchor write this many seconds (emulates a slow link)."),
    "residual_hold_s": (
        float,
        "Prefill: hold each chunk's Residual this many seconds, its layers leaving spread over "
        "them (emulates a slow link).",
    ),
    "layerwise_from": (
        int,
        "Prefill: a request of at least this many tokens sends each chunk's Anchor layer by "
        "layer while the chunk computes (default 2048; 0: off, each chunk's Anchor once it is "
        "computed).",
    ),
    "auth_key_file": (
        str,
        "A file holding a key (16+ bytes, not readable by others) both servers sign their Lynx "
        f"messages with; give both the same file, or neither. Default ${settings.AUTH_KEY_ENV}.",
    ),
}


def _add_lynx_args(_result: Any, parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Lynx (progressive, speculative KV transfer)")
    group.add_argument(
        "--lynx",
        action="store_true",
        help="Send KV as an Anchor (high priority) and a Residual (low priority). "
        "Needs --disaggregation-mode prefill|decode and a Mooncake transfer backend.",
    )
    for field, (kind, text) in _OPTIONS.items():
        group.add_argument(
            settings.flag_of(field),
            dest=_dest(field),
            type=kind,
            default=None,
            help=f"{text} Default {getattr(_DEFAULTS, field)}.",
        )


def settings_from_namespace(args: argparse.Namespace) -> LynxSettings | None:
    """The Lynx settings the command line asks for; None without ``--lynx``."""
    given = {
        field: getattr(args, _dest(field))
        for field in _OPTIONS
        if getattr(args, _dest(field), None) is not None
    }
    if not getattr(args, "lynx", False):
        if given:
            raise LynxSettingsError(f"{', '.join(map(settings.flag_of, given))} given without --lynx")
        return None
    if "auth_key_file" not in given and os.environ.get(settings.AUTH_KEY_ENV):
        given["auth_key_file"] = os.environ[settings.AUTH_KEY_ENV]
    return LynxSettings(**given)


def _dest(field: str) -> str:
    return "lynx_" + field


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def _apply_cpu_engine_defaults(args: argparse.Namespace) -> None:
    if args.disaggregation_mode == "null":
        return
    if args.disaggregation_mode == "decode":
        backup = args.disaggregation_decode_retraction_backup
        if backup == "host_pool":
            raise LynxSettingsError(
                "--disaggregation-decode-retraction-backup host_pool pins memory with "
                "cudaHostRegister, which the CPU engine cannot do; use cpu_tensor"
            )
        if backup is None:
            args.disaggregation_decode_retraction_backup = "cpu_tensor"
    if "SGLANG_HOST_IP" not in os.environ and _is_loopback(args.host):
        os.environ["SGLANG_HOST_IP"] = socket.gethostbyname(args.host)


def _attn_dp_size(args: argparse.Namespace) -> int:
    if getattr(args, "enable_dp_attention", False):  # deprecated spelling of --attn-dp-size <dp-size>
        return int(getattr(args, "dp_size", 1) or 1)
    return int(getattr(args, "attn_dp_size", 1) or 1)


def _from_cli_args(original: Any, cls: type, args: argparse.Namespace) -> Any:
    try:
        lynx_settings = settings_from_namespace(args)
        if is_cpu_engine():
            _apply_cpu_engine_defaults(args)
        if lynx_settings is not None:
            settings.check_server_compatibility(
                lynx_settings,
                disaggregation_mode=args.disaggregation_mode,
                transfer_backend=args.disaggregation_transfer_backend,
                attn_dp_size=_attn_dp_size(args),
                speculative_algorithm=getattr(args, "speculative_algorithm", None),
                decode_radix_cache=bool(getattr(args, "disaggregation_decode_enable_radix_cache", False)),
                kv_checksum=bool(getattr(args, "disaggregation_enable_kv_checksum", False)),
            )
            lynx_settings.auth_key()  # each process reads it again; a bad file stops the launcher
    except LynxSettingsError as exc:
        raise SystemExit(f"sglang-lynx: error: {exc}") from None
    server_args = original(cls, args)
    settings.publish(lynx_settings)
    if lynx_settings is not None:
        logger.info("Lynx on: %s", lynx_settings.to_json())
    return server_args


def register() -> None:
    hook(ADD_CLI_ARGS, _add_lynx_args, "after")
    hook(FROM_CLI_ARGS, _from_cli_args, "around")
