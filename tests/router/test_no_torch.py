"""The router process runs without torch: importing the router's modules (and the tools' CLI)
loads neither torch nor the replica package (DESIGN.md §1; import-linter checks the static graph,
this the imports that actually run)."""

from __future__ import annotations

import subprocess
import sys


def test_the_router_imports_neither_torch_nor_the_replica_package():
    code = ("import sys, router.server, router.proxy, kvroute.prompt, router.telemetry, kvroute_tools.cli; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'replica')); "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
