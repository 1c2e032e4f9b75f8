"""``python -m router [--flag ...]``: run one router (flags and KVROUTE_* variables: --help)."""

import sys

from kvroute.process import exit_process
from router.server import main

exit_process(main(sys.argv[1:]))
