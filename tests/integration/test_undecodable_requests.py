"""Request bytes that do not parse as the method's message, sent raw to the real router and
replica servers over a generic gRPC channel: INVALID_ARGUMENT naming the request, and one log line
without a traceback (kvroute/grpc_errors.py, DESIGN.md §3.3)."""

from __future__ import annotations

import logging

import grpc
import pytest

from router.server import BackgroundRouter
from router.settings import RouterSettings
from tests.support import thread_replica

GARBAGE = b"\xff\xff\xff\xff"  # field 31, wire type 7: no protobuf message parses it
T = 10.0


@pytest.fixture(scope="module")
def replica(default_model_dir):
    with thread_replica(default_model_dir, "garbage-replica") as r:
        yield r


@pytest.fixture(scope="module")
def router(default_model_dir, redis_server):
    settings = RouterSettings(host="127.0.0.1", port=0, redis_url=redis_server.url, model=str(default_model_dir))
    with BackgroundRouter(settings) as r:
        yield r


CASES = [
    ("router", "/kvroute.v1.GenerationService/Generate", "unary"),
    ("router", "/kvroute.v1.GenerationService/GenerateStream", "stream"),
    ("router", "/kvroute.v1.RouterService/Score", "unary"),
    ("replica", "/kvroute.v1.GenerationService/GenerateStream", "stream"),
    ("replica", "/kvroute.v1.ReplicaService/GenerateStream", "stream"),
    ("replica", "/kvroute.v1.ReplicaService/GetLoad", "unary"),
]


@pytest.mark.parametrize(("side", "method", "kind"), CASES, ids=[f"{c[0]}{c[1]}" for c in CASES])
def test_undecodable_request_bytes_get_invalid_argument_and_one_log_line(request, caplog, side, method, kind):
    target = request.getfixturevalue(side).target
    with caplog.at_level(logging.INFO), grpc.insecure_channel(target) as channel:
        if kind == "unary":
            call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
            with pytest.raises(grpc.RpcError) as err:
                call(GARBAGE, timeout=T)
        else:
            call = channel.unary_stream(method, request_serializer=None, response_deserializer=None)
            with pytest.raises(grpc.RpcError) as err:
                list(call(GARBAGE, timeout=T))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert err.value.details().startswith("request: not a valid ")
    lines = [r for r in caplog.records if "not a valid" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    assert not any(r.exc_info for r in caplog.records)
