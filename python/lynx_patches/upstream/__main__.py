"""``python -m lynx_patches.upstream``: check the installed SGLang against the contract."""

import sys

from lynx_patches import sgl_kernel
from lynx_patches._hooks import is_cpu_engine
from lynx_patches.upstream import CONTRACT
from lynx_patches.upstream.connector import metadata_frames_violation
from lynx_patches.upstream.contract import contract_violations

if is_cpu_engine():
    sgl_kernel.install()
found = contract_violations(CONTRACT)
frames = metadata_frames_violation()
for line in [*found, *([frames] if frames else [])]:
    print(line)
sys.exit(1 if found or frames else 0)
