"""``python -m replica.bridge [--flag ...]``: run one bridge beside a vLLM server (--help)."""

import sys

from replica.bridge.service import main

sys.exit(main(sys.argv[1:]))
