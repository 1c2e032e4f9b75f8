"""The bridge's modules run without torch: importing them loads neither torch nor any part of the
replica package but the Redis publisher it shares with the engine, so ``kvroute bridge`` installs
with the base package and the bridge extra only (import-linter checks the static graph, this the
imports that run)."""

from __future__ import annotations

import subprocess
import sys

MODULES = ("replica.bridge", "replica.bridge.vllm_events", "replica.bridge.rekey", "replica.bridge.sequence",
           "replica.bridge.service")


def test_the_bridge_imports_neither_torch_nor_the_replica_beyond_its_redis_publisher():
    code = (f"import sys, {', '.join(MODULES)}; "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'torch' "
            "or (m.split('.')[0] == 'replica' and m not in ('replica', 'replica.bridge') "
            "and not m.startswith(('replica.bridge.', 'replica.publisher')))); "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
