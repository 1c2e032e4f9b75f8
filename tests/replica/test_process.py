"""``python -m replica`` as a process: ready when health says so; on SIGTERM it drains (readiness
NOT_SERVING, no new calls, the calls in flight finish within ``--drain-timeout``, the rest aborted)
and exits 0."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time

import grpc
import pytest
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


@contextlib.contextmanager
def _replica(tmp_path, *flags: str):
    """A ``python -m replica`` process, ready; yields (proc, channel, log): ``log`` gets the process's
    output once it has ended (checked here for the ready and stopped lines)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "replica", "--port", str(port), "--num-blocks", "64", "--torch-threads", "1",
         "--model-cache-dir", str(tmp_path), "--replica-id", "proc-replica", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    log: list[str] = []
    try:
        health = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + 60
        while _readiness(health) != SERVING:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "replica not ready within 60s"
            time.sleep(0.1)
        yield proc, channel, log
    finally:
        channel.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.append(proc.stdout.read())
    assert "ready" in log[0] and "stopped" in log[0], log[0]


def _stream(channel, max_tokens: int):
    return gen_grpc.GenerationServiceStub(channel).GenerateStream(gen_pb.GenerateRequest(
        text="a long answer", sampling=gen_pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    ))


def test_sigterm_aborts_in_flight_streams_after_the_drain_timeout_and_exits_cleanly(tmp_path):
    with _replica(tmp_path, "--drain-timeout", "0.5") as (proc, channel, log):
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service="readiness"))
        assert next(watch).status == SERVING
        stream = _stream(channel, 1000)
        next(stream)

        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert next(watch).status == NOT_SERVING
        rest = list(stream)
        assert rest[-1].finish_reason == gen_pb.FINISH_REASON_ABORT
        assert proc.wait(timeout=10) == 0
        print(f"stopped in {time.monotonic() - t0:.2f}s")
        assert 0.5 <= time.monotonic() - t0 < 6.5


def test_sigterm_drains_refusing_new_calls_while_the_calls_in_flight_finish(tmp_path):
    with _replica(tmp_path, "--drain-timeout", "60") as (proc, channel, log):
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service="readiness"))
        assert next(watch).status == SERVING
        stream = _stream(channel, 300)
        first = next(stream)

        proc.send_signal(signal.SIGTERM)
        assert next(watch).status == NOT_SERVING
        with pytest.raises(grpc.RpcError) as refused:
            list(_stream(channel, 4))
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "shutting down" in refused.value.details()
        rest = list(stream)
        assert rest[-1].finish_reason == gen_pb.FINISH_REASON_LENGTH
        assert len(first.token_ids) + sum(len(d.token_ids) for d in rest) == 300  # not cut short
        assert proc.wait(timeout=10) == 0
    assert "draining 1 in-flight requests" in log[0]  # it was still running at SIGTERM
    assert "aborting" not in log[0]
