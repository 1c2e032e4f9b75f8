"""The endpoint picker's span through a real Envoy, received by a real OTLP receiver
(tests.support_otlp; the router exports over OTLP/gRPC, the replica over OTLP/HTTP): a call with
a W3C ``traceparent`` gets a ``kvroute.pick`` SERVER span continuing it, with the replica chosen
and the predicted cached tokens, and the replica's span is in the same trace (Envoy forwards the
header unchanged). A refused pick's span carries the refusal."""

from __future__ import annotations

import grpc
import pytest
from opentelemetry.proto.trace.v1 import trace_pb2

from kvroute.v1 import generation_pb2 as gen_pb
from kvroute.v1 import generation_pb2_grpc as gen_grpc
from kvroute_tools.envoy import EnvoyFront
from tests.integration.test_http_spans import attributes, spans_of, traced_cluster
from tests.integration.test_router_proxy import ids_request

T = 30.0
B = 16


@pytest.fixture(scope="module")
def envoy(redis_server, default_model_dir, receiver, tmp_path_factory):
    with traced_cluster(redis_server, default_model_dir, receiver, "picked", replica_over="http/protobuf",
                        picker_port=0) as r, \
            EnvoyFront(r.target, picker_target=r.picker_target, folder=tmp_path_factory.mktemp("envoy")) as e:
        yield e


def call(envoy, request: gen_pb.GenerateRequest, trace_id: str, parent: str) -> list[gen_pb.GenerateResponse]:
    with grpc.insecure_channel(envoy.target) as ch:
        return list(gen_grpc.GenerationServiceStub(ch).GenerateStream(
            request, timeout=T, metadata=[("traceparent", f"00-{trace_id}-{parent}-01")]))


def test_the_pick_is_a_span_in_the_callers_trace_beside_the_replicas(envoy, receiver):
    ids = list(range(20, 20 + 3 * B + 3))
    call(envoy, ids_request(ids), "11111111111111111111111111111111", "1111111111111111")  # caches 3 blocks
    trace_id, parent = "6bf92f3577b34da6a3ce929d0e0e4738", "00f067aa0ba902b8"
    out = call(envoy, ids_request(ids), trace_id, parent)
    assert out[-1].usage.cached_tokens == 3 * B
    [pick] = [s for s in spans_of(receiver, trace_id, "grpc", 1) if s.name == "kvroute.pick"]
    assert pick.kind == trace_pb2.Span.SPAN_KIND_SERVER and pick.parent_span_id.hex() == parent
    attrs = attributes(pick)
    assert (attrs["kvroute.replica_id"], attrs["kvroute.predicted_cached_tokens"], attrs["gen_ai.usage.input_tokens"]) \
        == ("rep-picked", 3 * B, len(ids))
    [replica] = [s for s in spans_of(receiver, trace_id, "http/protobuf", 1) if s.kind == trace_pb2.Span.SPAN_KIND_SERVER]
    assert replica.parent_span_id.hex() == parent  # the same trace, through Envoy
    assert attributes(replica)["kvroute.replica_id"] == "rep-picked"


def test_a_refused_pick_has_a_span_with_the_refusal(envoy, receiver):
    trace_id = "7bf92f3577b34da6a3ce929d0e0e4739"
    with pytest.raises(grpc.RpcError) as err:
        call(envoy, ids_request([1, 100000, 2]), trace_id, "00f067aa0ba902b9")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    [pick] = spans_of(receiver, trace_id, "grpc", 1)
    assert pick.name == "kvroute.pick" and pick.status.code == trace_pb2.Status.STATUS_CODE_ERROR
    assert attributes(pick)["error.type"] == "INVALID_ARGUMENT" and "prompt.token_ids" in pick.status.message
