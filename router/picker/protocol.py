"""The Endpoint Picker Protocol's facts (gateway-api-inference-extension, docs/proposals/004) as
ext_proc messages: what a gateway sends the picker and what the picker answers. No I/O, no routing.

    request  metadata_context.filter_metadata["envoy.lb.subset_hint"]
                 ["x-gateway-destination-endpoint-subset"] = ["ip:port", ...]   (optional)
    answer   header  x-gateway-destination-endpoint: "ip:port,ip:port,..."      (picked first)
             dynamic_metadata["envoy.lb"]["x-gateway-destination-endpoint"]: the same string
             dynamic_metadata["kvroute.routing"]: x-kvroute-replica, -predicted-cached-tokens (kvroute's)
             or ImmediateResponse 503 (no ready endpoint / empty or ineligible subset), 429 (shed)

The protocol's ``x-gateway-destination-endpoint-served`` (which endpoint of a list served the call,
after retries down it) is not read: the picker lists one endpoint unless ``picker_fallbacks`` says
otherwise, and then counts the load on the first.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import grpc
from envoy.config.core.v3 import base_pb2 as core_pb
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_pb
from envoy.type.v3 import http_status_pb2 as http_status_pb
from google.protobuf import struct_pb2

DESTINATION_HEADER = "x-gateway-destination-endpoint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
# kvroute's own: the pick as {trailer name: value} for the gateway to add to the client's trailers
# (kvroute_tools.envoy's header_mutation filter), without sending it the response trailers.
ROUTING_NAMESPACE = "kvroute.routing"
# A gateway that skips the request headers message (kvroute_tools.envoy's bootstrap) sends what the
# pick needs of them as ext_proc request attributes (CEL) with the body message, in this namespace.
ATTRIBUTES_NAMESPACE = "envoy.filters.http.ext_proc"
PATH_ATTRIBUTE = "request.path"
CONTENT_TYPE_ATTRIBUTE = "request.headers['content-type']"
# The caller's W3C trace context, for the pick's span (absent when the caller sent none).
TRACE_HEADERS = ("traceparent", "tracestate")
TRACE_ATTRIBUTES = {f"request.headers['{name}']": name for name in TRACE_HEADERS}


def header_map(headers: ext_pb.HttpHeaders | ext_pb.HttpTrailers | None,
               names: frozenset[str] | None = None) -> dict[str, str]:
    """An ext_proc header map as ``{lower-case name: value}`` (Envoy sends ``raw_value`` bytes;
    older gateways ``value``). A repeated name keeps its last value. With ``names`` (lower-case),
    only those are decoded and returned (the others cost a name comparison each)."""
    if headers is None:
        return {}
    entries = headers.headers.headers if isinstance(headers, ext_pb.HttpHeaders) else headers.trailers.headers
    out: dict[str, str] = {}
    for h in entries:
        key = h.key.lower()
        if names is None or key in names:
            raw = h.raw_value
            out[key] = raw.decode("utf-8", "replace") if raw else h.value
    return out


def path_and_content_type(msg: ext_pb.ProcessingRequest) -> tuple[str, str]:
    """(``:path``, ``content-type``) from the message's request attributes (``("", "")`` for those
    it lacks: a message of a gateway that sent the headers, or sends no attributes)."""
    attrs = msg.attributes.get(ATTRIBUTES_NAMESPACE)
    if attrs is None:
        return "", ""
    fields = attrs.fields
    path = fields[PATH_ATTRIBUTE].string_value if PATH_ATTRIBUTE in fields else ""
    content_type = fields[CONTENT_TYPE_ATTRIBUTE].string_value if CONTENT_TYPE_ATTRIBUTE in fields else ""
    return path, content_type


def trace_headers(msg: ext_pb.ProcessingRequest) -> dict[str, str]:
    """The W3C trace headers the gateway sent as request attributes (``{"traceparent": ...}``)."""
    attrs = msg.attributes.get(ATTRIBUTES_NAMESPACE)
    if attrs is None:
        return {}
    fields = attrs.fields
    return {name: fields[attr].string_value for attr, name in TRACE_ATTRIBUTES.items()
            if attr in fields and fields[attr].string_value}


def subset_hint(metadata: core_pb.Metadata) -> list[str] | None:
    """The endpoints the gateway allows (``ip:port`` strings), or None when it set no subset.

    An empty list means "none allowed" (the protocol's 503). A value that is one comma-separated
    string is accepted as well as a list of strings.
    """
    ns = metadata.filter_metadata.get(SUBSET_NAMESPACE)
    if ns is None or SUBSET_KEY not in ns.fields:
        return None
    value = ns.fields[SUBSET_KEY]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        items: Iterable[str] = (v.string_value for v in value.list_value.values)
    elif kind == "string_value":
        items = value.string_value.split(",")
    else:
        items = ()
    return [e.strip() for e in items if e.strip()]


def _header(name: str, value: str) -> core_pb.HeaderValueOption:
    return core_pb.HeaderValueOption(
        header=core_pb.HeaderValue(key=name, raw_value=value.encode()),
        append_action=core_pb.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


_CONTINUE_HEADERS = ext_pb.ProcessingResponse(request_headers=ext_pb.HeadersResponse())
_CONTINUE_RESPONSE_HEADERS = ext_pb.ProcessingResponse(response_headers=ext_pb.HeadersResponse())


def continue_headers() -> ext_pb.ProcessingResponse:
    """CONTINUE for a request headers message (the pick follows the body). One shared message:
    callers must not mutate it."""
    return _CONTINUE_HEADERS


def continue_response_headers() -> ext_pb.ProcessingResponse:
    """CONTINUE for a response headers message (shared, as :func:`continue_headers`)."""
    return _CONTINUE_RESPONSE_HEADERS


def destination(endpoints: Sequence[str], *, on_headers: bool = False,
                routing: Mapping[str, str] | None = None) -> ext_pb.ProcessingResponse:
    """The pick: ``endpoints`` (``ip:port``, the picked one first, then the fallbacks in order) in
    the destination header and the ``envoy.lb`` dynamic metadata, the same string in both (the
    protocol forbids two values); ``routing`` (trailer name -> value) in the ``kvroute.routing``
    metadata. Answers the request body message, or the headers message with ``on_headers`` (a call
    without a body).

    Raises:
        ValueError: ``endpoints`` is empty (answer :func:`immediate` instead).
    """
    if not endpoints:
        raise ValueError("endpoints: at least one is needed")
    value = ",".join(endpoints)
    common = ext_pb.CommonResponse(header_mutation=ext_pb.HeaderMutation(set_headers=[_header(DESTINATION_HEADER, value)]),
                                   clear_route_cache=False)
    md = struct_pb2.Struct()
    md.fields[LB_NAMESPACE].struct_value.fields[DESTINATION_HEADER].string_value = value
    for k, v in (routing or {}).items():
        md.fields[ROUTING_NAMESPACE].struct_value.fields[k].string_value = v
    if on_headers:
        return ext_pb.ProcessingResponse(request_headers=ext_pb.HeadersResponse(response=common), dynamic_metadata=md)
    return ext_pb.ProcessingResponse(request_body=ext_pb.BodyResponse(response=common), dynamic_metadata=md)


def immediate(http_status: int, code: grpc.StatusCode | None, details: str, body: bytes = b"",
              headers: Mapping[str, str] | None = None) -> ext_pb.ProcessingResponse:
    """An ImmediateResponse: the gateway answers the client itself with ``http_status`` (gRPC
    clients: ``code`` as grpc-status, ``details`` as grpc-message), and nothing goes upstream."""
    resp = ext_pb.ImmediateResponse(status=http_status_pb.HttpStatus(code=http_status), body=body, details=details)
    if code is not None:  # a gRPC call: Envoy sends a trailers-only reply, the body as grpc-message
        resp.grpc_status.status = code.value[0]
        resp.body = details.encode()
    for k, v in (headers or {}).items():
        resp.headers.set_headers.append(_header(k, v))
    return ext_pb.ProcessingResponse(immediate_response=resp)


def trailers_response(add: Mapping[str, str]) -> ext_pb.ProcessingResponse:
    """The answer to the response trailers message, adding ``add`` to the client's trailers."""
    return ext_pb.ProcessingResponse(response_trailers=ext_pb.TrailersResponse(
        header_mutation=ext_pb.HeaderMutation(set_headers=[_header(k, v) for k, v in add.items()])))


__all__ = [
    "ATTRIBUTES_NAMESPACE",
    "CONTENT_TYPE_ATTRIBUTE",
    "PATH_ATTRIBUTE",
    "DESTINATION_HEADER",
    "LB_NAMESPACE",
    "ROUTING_NAMESPACE",
    "SUBSET_KEY",
    "SUBSET_NAMESPACE",
    "continue_headers",
    "continue_response_headers",
    "destination",
    "header_map",
    "immediate",
    "path_and_content_type",
    "subset_hint",
    "trailers_response",
]
