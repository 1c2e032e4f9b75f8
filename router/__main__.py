"""``python -m router [--flag ...]``: run one router (flags and KVROUTE_* variables: --help)."""

import sys

from router.server import main

sys.exit(main(sys.argv[1:]))
