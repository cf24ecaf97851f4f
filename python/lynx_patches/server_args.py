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
from typing import Any

from lynx import settings
from lynx.settings import LynxSettings, LynxSettingsError
from lynx_patches._hooks import hook, is_cpu_engine

logger = logging.getLogger(__name__)

ADD_CLI_ARGS = "server_args.ServerArgs.add_cli_args"
FROM_CLI_ARGS = "server_args.ServerArgs.from_cli_args"

_DEFAULTS = LynxSettings()
# (flag, LynxSettings field, type, help). Defaults are None on the parser so that a
# --lynx-* flag given without --lynx can be told apart from an untouched default.
_OPTIONS: tuple[tuple[str, str, type, str], ...] = (
    (
        "--lynx-mode",
        "mode",
        str,
        f"When decode starts: full (after Anchor+Residual), anchor-only, speculative. "
        f"Default {_DEFAULTS.mode}.",
    ),
    (
        "--lynx-anchor-bits",
        "anchor_bits",
        int,
        f"Upper bits of each INT8 code sent in the Anchor (2..4). Default {_DEFAULTS.anchor_bits}.",
    ),
    (
        "--lynx-group-size",
        "group_size",
        int,
        f"Values per quantization group (a power of two dividing head_dim). Default {_DEFAULTS.group_size}.",
    ),
    (
        "--lynx-residual",
        "residual",
        str,
        f"Residual precision: int8 (Anchor+Residual = INT8) or exact (bit-exact BF16/FP16). "
        f"Default {_DEFAULTS.residual}.",
    ),
    (
        "--lynx-max-speculative-tokens",
        "max_speculative_tokens",
        int,
        f"Most tokens a request may hold back before its Residual lands. "
        f"Default {_DEFAULTS.max_speculative_tokens}.",
    ),
    (
        "--lynx-lane-chunk-bytes",
        "lane_chunk_bytes",
        settings.parse_size,
        f"Residual chunk size on the low-priority lane (e.g. 1MiB). Default {_DEFAULTS.lane_chunk_bytes}.",
    ),
    (
        "--lynx-transfer-deadline",
        "transfer_deadline_s",
        float,
        f"Seconds a request's KV transfer may take before it fails. "
        f"Default {_DEFAULTS.transfer_deadline_s:g}.",
    ),
)


def _add_lynx_args(_result: Any, parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Lynx (progressive, speculative KV transfer)")
    group.add_argument(
        "--lynx",
        action="store_true",
        help="Send KV as an Anchor (high priority) and a Residual (low priority). "
        "Needs --disaggregation-mode prefill|decode and a Mooncake transfer backend.",
    )
    for flag, _field, kind, text in _OPTIONS:
        group.add_argument(flag, type=kind, default=None, help=text)


def settings_from_namespace(args: argparse.Namespace) -> LynxSettings | None:
    """The Lynx settings the command line asks for; None without ``--lynx``."""
    given = {
        field: getattr(args, field_dest(flag))
        for flag, field, _kind, _text in _OPTIONS
        if getattr(args, field_dest(flag), None) is not None
    }
    if not getattr(args, "lynx", False):
        if given:
            flags = ", ".join(flag for flag, field, _k, _t in _OPTIONS if field in given)
            raise LynxSettingsError(f"{flags} given without --lynx")
        return None
    return LynxSettings(**given)


def field_dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


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
            )
    except LynxSettingsError as exc:
        raise SystemExit(f"sglang-lynx: error: {exc}") from None
    server_args = original(cls, args)
    settings.publish(lynx_settings)
    if lynx_settings is not None:
        logger.info("Lynx on: %s", lynx_settings.to_json())
        logger.warning(
            "Lynx: settings validated and handed to the scheduler; the Anchor/Residual "
            "transfer path is not built yet, so KV still travels as the upstream copy"
        )
    return server_args


def register() -> None:
    hook(ADD_CLI_ARGS, _add_lynx_args, "after")
    hook(FROM_CLI_ARGS, _from_cli_args, "around")
