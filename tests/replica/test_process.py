"""``python -m replica`` as a process: ready when health says so, graceful on SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvroute.v1 import generation_pb2 as gen_pb
from kvroute.v1 import generation_pb2_grpc as gen_grpc
from kvroute_tools.redis_server import free_port

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _readiness(stub) -> int | None:
    try:
        return stub.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=1).status
    except grpc.RpcError:
        return None


def test_sigterm_aborts_in_flight_streams_and_exits_cleanly_within_seconds(tmp_path):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "replica", "--port", str(port), "--num-blocks", "64", "--torch-threads", "1",
         "--model-cache-dir", str(tmp_path), "--replica-id", "proc-replica"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        health = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + 60
        while _readiness(health) != SERVING:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "replica not ready within 60s"
            time.sleep(0.1)
        watch = health.Watch(health_pb2.HealthCheckRequest(service="readiness"))
        assert next(watch).status == SERVING
        stream = gen_grpc.GenerationServiceStub(channel).GenerateStream(gen_pb.GenerateRequest(
            text="a long answer", sampling=gen_pb.SamplingParams(max_tokens=3000, temperature=0.0, ignore_eos=True),
        ))
        next(stream)

        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert next(watch).status == NOT_SERVING
        rest = list(stream)
        assert rest[-1].finish_reason == gen_pb.FINISH_REASON_ABORT
        assert proc.wait(timeout=10) == 0
        print(f"stopped in {time.monotonic() - t0:.2f}s")
        assert time.monotonic() - t0 < 6.0
        channel.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = proc.stdout.read()
    assert "ready" in out and "stopped" in out, out
