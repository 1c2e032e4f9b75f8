"""``python -m replica.bridge [--flag ...]``: run one bridge beside a vLLM server (--help)."""

import sys

from kvroute.process import exit_process
from replica.bridge.service import main

exit_process(main(sys.argv[1:]))
