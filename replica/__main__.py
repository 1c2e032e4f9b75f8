"""``python -m replica [--flag ...]``: run one replica (flags and KVROUTE_* variables: --help)."""

import sys

from replica.server import main

sys.exit(main(sys.argv[1:]))
