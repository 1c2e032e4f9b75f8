import sys

from kvroute_tools.cli import main

sys.exit(main())
