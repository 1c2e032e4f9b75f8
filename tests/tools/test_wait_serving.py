"""kvroute_tools.supervise.wait_serving: returns once a child's grpc.health.v1 readiness is SERVING, fails
with the child's details when it exits first or never gets ready."""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvroute_tools.redis_server import free_port
from kvroute_tools.supervise import wait_serving


def test_returns_when_readiness_turns_serving():
    server = grpc.server(futures.ThreadPoolExecutor(2))
    checks = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(checks, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        checks.set("readiness", health_pb2.HealthCheckResponse.NOT_SERVING)
        t0 = time.monotonic()
        with futures.ThreadPoolExecutor(1) as later:
            later.submit(lambda: (time.sleep(0.5), checks.set("readiness", health_pb2.HealthCheckResponse.SERVING)))
            wait_serving(f"127.0.0.1:{port}", sleeper, "fake", timeout=10)
        assert time.monotonic() - t0 >= 0.5
    finally:
        sleeper.kill()
        sleeper.wait()
        server.stop(0)


def test_a_child_that_exits_first_fails_with_its_details():
    child = subprocess.Popen([sys.executable, "-c", "import sys; print('boom', file=sys.stderr); sys.exit(3)"],
                             stderr=subprocess.PIPE, text=True)
    with pytest.raises(RuntimeError, match=r"(?s)thing exited with status 3.*boom"):
        wait_serving(f"127.0.0.1:{free_port()}", child, "thing", timeout=10, details=child.stderr.read)


def test_a_child_never_ready_is_killed_at_the_timeout():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    with pytest.raises(RuntimeError, match="sleeper not ready within 1 s"):
        wait_serving(f"127.0.0.1:{free_port()}", child, "sleeper", timeout=1)
    assert child.poll() is not None
