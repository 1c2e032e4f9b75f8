"""router.picker.protocol: the Endpoint Picker Protocol's messages (gateway-api-inference-extension
docs/proposals/004), built and read without a gateway."""

from __future__ import annotations

import grpc
from envoy.config.core.v3 import base_pb2 as core_pb
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_pb

from router.picker import protocol


def hint(value=None, *, as_string: str | None = None) -> core_pb.Metadata:
    md = core_pb.Metadata()
    field = md.filter_metadata["envoy.lb.subset_hint"].fields["x-gateway-destination-endpoint-subset"]
    if as_string is not None:
        field.string_value = as_string
    else:
        field.list_value.SetInParent()
        for v in value:
            field.list_value.values.add().string_value = v
    return md


def test_subset_hint_absent_empty_list_and_string():
    assert protocol.subset_hint(core_pb.Metadata()) is None
    assert protocol.subset_hint(hint([])) == []
    assert protocol.subset_hint(hint(["10.0.0.1:8000", "10.0.0.2:8000"])) == ["10.0.0.1:8000", "10.0.0.2:8000"]
    assert protocol.subset_hint(hint(as_string="10.0.0.1:8000, 10.0.0.2:8000")) == ["10.0.0.1:8000", "10.0.0.2:8000"]


def test_destination_sets_the_same_value_in_the_header_and_the_envoy_lb_metadata():
    resp = protocol.destination(["10.0.0.1:8000", "10.0.0.2:8000"])
    header = resp.request_body.response.header_mutation.set_headers[0].header
    value = resp.dynamic_metadata.fields["envoy.lb"].struct_value.fields["x-gateway-destination-endpoint"]
    assert header.key == "x-gateway-destination-endpoint"
    assert header.raw_value.decode() == value.string_value == "10.0.0.1:8000,10.0.0.2:8000"
    assert protocol.destination(["10.0.0.1:8000"], on_headers=True).HasField("request_headers")


def test_destination_carries_the_routing_trailers_in_their_own_namespace():
    resp = protocol.destination(["10.0.0.1:8000"], routing={"x-kvroute-replica": "r1"})
    md = resp.dynamic_metadata.fields
    assert set(md) == {"envoy.lb", "kvroute.routing"}
    assert md["kvroute.routing"].struct_value.fields["x-kvroute-replica"].string_value == "r1"
    assert set(protocol.destination(["10.0.0.1:8000"]).dynamic_metadata.fields) == {"envoy.lb"}


def test_immediate_response_for_grpc_carries_the_status_and_message():
    resp = protocol.immediate(503, grpc.StatusCode.UNAVAILABLE, "no replica is routable").immediate_response
    assert resp.status.code == 503
    assert resp.grpc_status.status == 14
    assert resp.body == b"no replica is routable"


def test_header_map_reads_raw_values_and_values_by_lower_case_name():
    headers = ext_pb.HttpHeaders(headers=core_pb.HeaderMap(headers=[
        core_pb.HeaderValue(key=":path", raw_value=b"/x"), core_pb.HeaderValue(key="Content-Type", value="a")]))
    assert protocol.header_map(headers) == {":path": "/x", "content-type": "a"}


def test_header_map_with_names_decodes_only_those():
    headers = ext_pb.HttpHeaders(headers=core_pb.HeaderMap(headers=[
        core_pb.HeaderValue(key=":path", raw_value=b"/x"), core_pb.HeaderValue(key="Content-Type", value="a"),
        core_pb.HeaderValue(key="user-agent", raw_value=b"grpc")]))
    assert protocol.header_map(headers, frozenset({"content-type", "absent"})) == {"content-type": "a"}


def test_path_and_content_type_come_from_the_request_attributes():
    msg = ext_pb.ProcessingRequest(request_body=ext_pb.HttpBody(body=b"", end_of_stream=True))
    assert protocol.path_and_content_type(msg) == ("", "")
    fields = msg.attributes[protocol.ATTRIBUTES_NAMESPACE].fields
    fields["request.path"].string_value = "/v1/completions"
    assert protocol.path_and_content_type(msg) == ("/v1/completions", "")
    fields["request.headers['content-type']"].string_value = "application/json"
    assert protocol.path_and_content_type(msg) == ("/v1/completions", "application/json")
