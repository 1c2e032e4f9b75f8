"""The OpenAI HTTP front's traces, received by a real OTLP receiver (tests.support_otlp): the
router exports over OTLP/HTTP (protobuf), the replica over OTLP/gRPC. A chat completion through the
router's HTTP API is one trace: the router's HTTP SERVER span named and attributed as
OpenTelemetry's HTTP semantic conventions say, its INTERNAL request-path child, the CLIENT attempt
to the replica, and the replica's SERVER span carrying the replica id. A request refused with 400
has its span too (status left unset, as the conventions say for a 4xx on a server)."""

from __future__ import annotations

import contextlib

import httpx2
import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter
from opentelemetry.proto.trace.v1 import trace_pb2

from kvroute.telemetry import setup_telemetry
from replica.server import BackgroundReplica
from replica.settings import ReplicaSettings
from router.server import BackgroundRouter
from router.settings import RouterSettings
from tests.support import wait_for

T = 30.0
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


@contextlib.contextmanager
def traced_cluster(redis_server, model_dir, receiver, namespace: str, *, replica_over: str, **router_settings):
    """One replica and one router, each exporting spans to ``receiver`` (the replica over
    ``replica_over``, ``"grpc"`` or ``"http/protobuf"``, the router over the other), the replica
    ``rep-<namespace>``; yields the BackgroundRouter once the replica is routable."""
    grpc_exporter = GrpcSpanExporter(endpoint=receiver.grpc_endpoint, insecure=True)
    http_exporter = HttpSpanExporter(endpoint=f"{receiver.http_endpoint}/v1/traces")
    replica_exporter, router_exporter = ((grpc_exporter, http_exporter) if replica_over == "grpc"
                                         else (http_exporter, grpc_exporter))
    replica_telemetry = setup_telemetry("kvroute-replica", otlp=False, span_exporters=[replica_exporter])
    router_telemetry = setup_telemetry("kvroute-router", otlp=False, span_exporters=[router_exporter])
    replica = ReplicaSettings(host="127.0.0.1", port=0, model=str(model_dir), replica_id=f"rep-{namespace}",
                              redis_url=redis_server.url, namespace=namespace, num_blocks=64, torch_threads=1,
                              heartbeat_interval=0.2, heartbeat_ttl=5.0, max_num_seqs=2)
    settings = RouterSettings(host="127.0.0.1", port=0, redis_url=redis_server.url, namespace=namespace,
                              model=str(model_dir), heartbeat_poll_interval=0.1, **router_settings)
    try:
        with BackgroundReplica(replica, telemetry=replica_telemetry), \
                BackgroundRouter(settings, telemetry=router_telemetry) as r:
            wait_for(lambda: len(r.server.registry.routable()) == 1, what="replica routable")
            yield r
    finally:
        router_telemetry.shutdown()
        replica_telemetry.shutdown()


@pytest.fixture(scope="module")
def router(redis_server, default_model_dir, receiver):
    with traced_cluster(redis_server, default_model_dir, receiver, "traced", replica_over="grpc", http_port=0) as r:
        yield r


def attributes(span) -> dict:
    return {a.key: getattr(a.value, a.value.WhichOneof("value")) for a in span.attributes}


def post(router, body: dict, trace_id: str) -> httpx2.Response:
    url = f"http://127.0.0.1:{router.server.http_port}/v1/chat/completions"
    headers = {"traceparent": f"00-{trace_id}-00f067aa0ba902b7-01", "user-agent": "kvroute-test"}
    return httpx2.post(url, json=body, headers=headers, timeout=T)


def spans_of(receiver, trace_id: str, transport: str, count: int) -> list:
    def found():
        spans = [s for s in receiver.received[transport] if s.trace_id.hex() == trace_id]
        return spans if len(spans) >= count else None

    return wait_for(found, what=f"{count} {transport} spans of the trace")


def test_a_chat_completion_is_one_trace_from_the_http_span_to_the_replica(router, receiver):
    body = {"model": "kvroute-tiny-llama", "max_tokens": 3, "messages": [{"role": "user", "content": "traced"}]}
    assert post(router, body, TRACE_ID).status_code == 200
    router_spans = spans_of(receiver, TRACE_ID, "http/protobuf", 3)
    [http] = [s for s in router_spans if s.kind == trace_pb2.Span.SPAN_KIND_SERVER]
    assert http.name == "POST /v1/chat/completions"
    assert http.parent_span_id.hex() == "00f067aa0ba902b7"  # the caller's traceparent continued
    attrs = attributes(http)
    assert {k: attrs[k] for k in ("http.request.method", "http.route", "url.path", "url.scheme",
                                  "http.response.status_code", "user_agent.original")} == {
        "http.request.method": "POST", "http.route": "/v1/chat/completions", "url.path": "/v1/chat/completions",
        "url.scheme": "http", "http.response.status_code": 200, "user_agent.original": "kvroute-test"}
    assert not [k for k in attrs if k.startswith("rpc.")]
    [path] = [s for s in router_spans if s.kind == trace_pb2.Span.SPAN_KIND_INTERNAL]
    assert path.parent_span_id == http.span_id and not [k for k in attributes(path) if k.startswith("rpc.")]
    assert attributes(path)["gen_ai.operation.name"] == "chat"
    [attempt] = [s for s in router_spans if s.kind == trace_pb2.Span.SPAN_KIND_CLIENT]
    assert attempt.parent_span_id == path.span_id
    [replica] = [s for s in spans_of(receiver, TRACE_ID, "grpc", 1) if s.kind == trace_pb2.Span.SPAN_KIND_SERVER]
    assert replica.parent_span_id == attempt.span_id  # over OTLP/gRPC, joined by the trace context
    assert attributes(replica)["kvroute.replica_id"] == "rep-traced"


def test_a_request_refused_with_400_has_its_span(router, receiver):
    trace_id = "5bf92f3577b34da6a3ce929d0e0e4737"
    body = {"model": "kvroute-tiny-llama", "max_tokens": -1, "messages": [{"role": "user", "content": "bad"}]}
    assert post(router, body, trace_id).status_code == 400
    [span] = spans_of(receiver, trace_id, "http/protobuf", 1)
    assert span.name == "POST /v1/chat/completions" and span.kind == trace_pb2.Span.SPAN_KIND_SERVER
    assert attributes(span)["http.response.status_code"] == 400
    assert span.status.code == trace_pb2.Status.STATUS_CODE_UNSET  # a 4xx is the client's, not the server's
