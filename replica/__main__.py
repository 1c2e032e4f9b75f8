"""``python -m replica [--flag ...]``: run one replica (flags and KVROUTE_* variables: --help)."""

import sys

from kvroute.process import exit_process
from replica.server import main

exit_process(main(sys.argv[1:]))
