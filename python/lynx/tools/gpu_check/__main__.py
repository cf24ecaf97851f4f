"""``python -m lynx.tools.gpu_check``: the command line of ``runner.main``."""

import sys

from lynx.tools.gpu_check.runner import main

if __name__ == "__main__":
    sys.exit(main())
