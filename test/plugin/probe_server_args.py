"""Runs in a fresh interpreter: load the plugins as SGLang does, then parse command lines.

Prints one JSON object: the hook targets that were applied, and for each case either the
published Lynx settings and a few ServerArgs fields, or the start-up error.
"""

import json
import os
import sys

from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry

load_plugins()

from sglang.srt.server_args import prepare_server_args  # noqa: E402

cases = json.loads(sys.argv[1])
results = {"patched": sorted(HookRegistry._patched), "registered": sorted(HookRegistry._hooks), "cases": {}}
for name, argv in cases.items():
    os.environ.pop("LYNX_SETTINGS", None)
    try:
        args = prepare_server_args(argv)
    except SystemExit as exc:
        results["cases"][name] = {"error": str(exc.code)}
        continue
    results["cases"][name] = {
        "lynx": json.loads(os.environ["LYNX_SETTINGS"]) if "LYNX_SETTINGS" in os.environ else None,
        "retraction_backup": args.disaggregation_decode_retraction_backup,
        "host_ip": os.environ.get("SGLANG_HOST_IP"),
    }

from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class  # noqa: E402

from lynx.settings import LynxSettings  # noqa: E402

kinds = {"manager": KVClassType.MANAGER, "sender": KVClassType.SENDER, "receiver": KVClassType.RECEIVER}
for label, settings_json in (("kv_classes_plain", None), ("kv_classes_lynx", LynxSettings().to_json())):
    os.environ.pop("LYNX_SETTINGS", None)
    if settings_json is not None:
        os.environ["LYNX_SETTINGS"] = settings_json
    results[label] = {k: get_kv_class(TransferBackend.MOONCAKE, t).__name__ for k, t in kinds.items()}
print("PROBE-RESULT " + json.dumps(results))
