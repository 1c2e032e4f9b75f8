"""``envoy.service.ext_proc.v3.ExternalProcessor/Process``: one ext_proc stream per HTTP call,
answered with the routing service (router.routing; router.picker's table). Served by router.picker.server
(a synchronous grpc.server: each stream on a pool thread, for as long as its HTTP call).

One stream, as a gateway that sends the request headers drives it::

    ← request_headers   remember :path, content-type                       → CONTINUE
    ← request_body      (buffered, end_of_stream) → GenerateRequest → token ids
                        → RoutingService.route (the subset hint, full queues, decide + commit as
                          one step: the proxy and the other streams pick too)
                        → destination(picked, fallbacks...) + the pick as kvroute.routing metadata
                          | ImmediateResponse 400 / 503 / 429
    ← response_trailers (a sampled share, kvroute_tools.envoy) grpc-status, x-kvroute-cached-tokens
                        → prediction accuracy → + x-kvroute-replica, x-kvroute-predicted-cached-tokens,
                          and the picker ends the stream (the last message Envoy sends)
    stream end / cancel → ticket finished (exactly once, after the stream's last answer), metrics recorded

Envoy configured by ``kvroute_tools.envoy`` skips the headers message (one message fewer on the way
to the first byte): the body comes first, with :path and content-type as its request attributes
(``protocol.path_and_content_type``), and the pick is read from the ``envoy.lb`` metadata. Without
the trailers message the stream still lasts until the HTTP stream ends (Envoy closes it then).

The response headers are not asked for: Envoy would hold the first bytes until the picker
answered, a Python wake-up on every call's time to first token. So the prompt's share of the
replica's pending prefill (``LoadTracker``) is not released at the first byte, as the proxy
does, but once a heartbeat the replica wrote at least ``_COVERED_AFTER_S`` after the pick is in
the registry: its ``queued_prefill_tokens`` then counts
the prompt if it still waits (the decision takes the larger of the two), or no longer does.

Errors never leave the picker as a gRPC error of its own (Envoy would answer the client 500): a
refused prompt is an ImmediateResponse with the status the proxy gives it
(router.routing.classify_error).
"""

from __future__ import annotations

import collections
import json
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc
from opentelemetry import propagate
from opentelemetry.trace import SpanKind

from kvroute.heartbeat import ENGINE_KVROUTE, ENGINE_VLLM
from kvroute.openai_api import error_response
from kvroute.prompt import InvalidRequestError, UnknownModelError
from kvroute.responses import MD_CACHED_TOKENS, MD_PREDICTED, MD_REPLICA
from kvroute.telemetry import ATTR_INPUT_TOKENS, ATTR_OPERATION, ATTR_REPLICA, set_span_error
from router.core import Decision
from router.load import Ticket
from router.picker import protocol
from router.picker.requests import OPENAI_CHAT, generate_request, is_generation, is_grpc
from router.routing import NoReplicaError, QueuesFullError, RoutingService, classify_error
from router.telemetry import ATTR_PREDICTED

log = logging.getLogger(__name__)

_REQUEST_HEADERS = frozenset({":path", "content-type"})  # what the pick reads of the request headers
PICK_SPAN = "kvroute.pick"
_TRAILERS = frozenset({"grpc-status", MD_CACHED_TOKENS})
_COVERED_AFTER_S = 0.25  # a heartbeat written this long after a pick reflects the request's admission


@dataclass(eq=False)
class _Call:
    """What one ext_proc stream knows about its HTTP call."""

    t0: float = field(default_factory=time.perf_counter)
    path: str = ""
    content_type: str = ""
    decision: Decision | None = None
    ticket: Ticket | None = None
    picked_at: float = 0.0  # wall clock (Unix seconds), against the heartbeats' ``written_at``
    cached_tokens: int | None = None
    status: str = ""  # the call's final grpc-status name, or the picker's refusal
    refusal: str = ""  # the refusal's message
    answered_trailers: bool = False  # nothing more will come: the stream can end
    over_limit: bool = False  # opened past the picker's max_calls: refused at its pick
    operation: str = "text_completion"
    trace_headers: dict[str, str] | None = None  # the caller's traceparent / tracestate (read when tracing)

    @property
    def grpc(self) -> bool:
        return is_grpc(self.content_type)


class EndpointPicker(ext_grpc.ExternalProcessorServicer):
    """The endpoint picker over the routing service.

    Args:
        routing: the routing steps (checked ids, route, prefill_done, finish; its ``metrics``).
        fallbacks: endpoints listed after the pick, next-best first (0: the pick alone, what an
            ORIGINAL_DST cluster reading the header needs: it takes one address).
        max_calls: calls in flight through the picker at most (``picker_streams``; None: no
            bound); the call past it is refused before any pick with RESOURCE_EXHAUSTED (HTTP 429)
            and a message naming the limit.
        tracer: makes one SERVER span per pick (``kvroute.pick``: the replica chosen, the
            predicted cached tokens, or the refusal), continuing the caller's W3C trace context,
            which Envoy forwards unchanged to the replica: the replica's span is in the same trace.
            None: no spans.
    """

    def __init__(self, routing: RoutingService, *, fallbacks: int = 0, max_calls: int | None = None,
                 tracer: Any = None) -> None:
        self._routing = routing
        self._tracer = tracer
        # The trace headers are decoded only for a span: no cost per call when nothing traces.
        self._header_names = _REQUEST_HEADERS | set(protocol.TRACE_HEADERS) if tracer is not None else _REQUEST_HEADERS
        self._fallbacks = fallbacks
        self.max_calls = max_calls
        self._open = 0  # streams being served now (the pool's threads), under _lock
        self._unsettled: collections.deque[_Call] = collections.deque()  # picked, prefill still pending, in pick order
        self._lock = threading.Lock()  # _unsettled: the pool's threads pick concurrently

    @property
    def open_streams(self) -> int:
        """Streams being served now (one per HTTP call through the gateway)."""
        with self._lock:
            return self._open

    def Process(self, request_iterator: Iterator[ext_pb.ProcessingRequest],
                context: grpc.ServicerContext) -> Iterator[ext_pb.ProcessingResponse]:
        # One pool thread per stream, for as long as the HTTP call lasts (router.picker.server).
        call = _Call()
        with self._lock:
            self._open += 1
            call.over_limit = self.max_calls is not None and self._open > self.max_calls
        try:
            for msg in request_iterator:
                yield self._answer(call, msg)
                if call.answered_trailers:
                    return
        finally:
            # The HTTP stream ended (completion, error, client cancel: Envoy closes this stream
            # with it; a cancel ends the iteration with an RpcError). After every answer of the
            # stream: a ticket committed by one is never missed.
            with self._lock:
                self._open -= 1
            if call.ticket is not None:
                self._routing.finish(call.ticket)
            self._record(call, time.perf_counter() - call.t0)

    def _answer(self, call: _Call, msg: ext_pb.ProcessingRequest) -> ext_pb.ProcessingResponse:
        """The answer to one message of the stream (the module docstring's table)."""
        kind = msg.WhichOneof("request")
        if kind == "request_headers":
            headers = protocol.header_map(msg.request_headers, self._header_names)
            call.path = headers.get(":path", "").split("?", 1)[0]
            call.content_type = headers.get("content-type", "")
            if self._tracer is not None:
                call.trace_headers = {k: v for k, v in headers.items() if k in protocol.TRACE_HEADERS}
            if msg.request_headers.end_of_stream or not is_generation(call.path):
                return self._pick(call, msg, None, on_headers=True)  # no prompt: any routable replica
            return protocol.continue_headers()
        if kind == "request_body":
            if call.decision is not None or call.status:  # picked (or refused) on the headers
                return ext_pb.ProcessingResponse(request_body=ext_pb.BodyResponse())
            if not call.path:  # the headers message was skipped: what the pick needs came along
                path, call.content_type = protocol.path_and_content_type(msg)
                call.path = path.split("?", 1)[0]
                if self._tracer is not None:
                    call.trace_headers = protocol.trace_headers(msg)
            return self._pick(call, msg, msg.request_body.body if is_generation(call.path) else None,
                              on_headers=False)
        if kind == "response_headers":  # a gateway configured to send them: the first bytes
            if call.ticket is not None:
                self._routing.prefill_done(call.ticket)
            return protocol.continue_response_headers()
        if kind == "response_trailers":
            return self._trailers(call, protocol.header_map(msg.response_trailers, _TRAILERS))
        return _pass_through(kind)  # a mode we did not ask for: let it pass unchanged

    # -- the pick ----------------------------------------------------------------------------------
    def _pick(self, call: _Call, msg: ext_pb.ProcessingRequest, body: bytes | None, *,
              on_headers: bool) -> ext_pb.ProcessingResponse:
        if self._tracer is None:
            return self._decide(call, msg, body, on_headers=on_headers)
        span = self._tracer.start_span(PICK_SPAN, context=propagate.extract(call.trace_headers or {}), kind=SpanKind.SERVER)
        try:
            return self._decide(call, msg, body, on_headers=on_headers)
        finally:
            d = call.decision
            span.set_attribute(ATTR_OPERATION, call.operation)
            if d is not None and d.picked is not None and not call.status:
                span.set_attributes({ATTR_REPLICA: d.picked.replica_id, ATTR_PREDICTED: d.predicted_cached_tokens,
                                     ATTR_INPUT_TOKENS: d.prompt_tokens})
            if call.status:
                set_span_error(span, (call.status, call.refusal))
            span.end()

    def _decide(self, call: _Call, msg: ext_pb.ProcessingRequest, body: bytes | None, *,
                on_headers: bool) -> ext_pb.ProcessingResponse:
        subset = protocol.subset_hint(msg.metadata_context)
        if call.over_limit:
            return self._refuse(call, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"endpoint picker: the calls in flight are at its limit, picker_streams={self.max_calls};"
                                " retry later")
        try:
            ids: Sequence[int] = ()
            salt = ""
            if body is not None:
                request = generate_request(call.path, call.content_type, body)
                call.operation = "chat" if request.WhichOneof("prompt") == "chat" else "text_completion"
                ids = self._routing.checked_ids(request)  # refused before any pick
                salt = request.cache_salt
            self._settle_prefill()
            # The gateway forwards the call unchanged to the address in the replica's heartbeat: a
            # kvroute replica serves gRPC there, a vLLM replica its OpenAI HTTP API.
            route = self._routing.route(ids, salt, subset=subset,
                                        engines=(ENGINE_KVROUTE,) if call.grpc else (ENGINE_VLLM,))
        except (InvalidRequestError, UnknownModelError, NoReplicaError, QueuesFullError) as e:
            if isinstance(e, NoReplicaError):
                call.decision = e.decision
            code, message = classify_error(e) or (grpc.StatusCode.INTERNAL, str(e))
            return self._refuse(call, code, message)
        call.decision, call.ticket = route.decision, route.ticket
        call.picked_at = time.time()
        with self._lock:
            self._unsettled.append(call)
        endpoints = [route.replica.address, *self._routing.next_best(route.decision, self._fallbacks)]
        return protocol.destination(endpoints, on_headers=on_headers, routing=_routing(route.decision))

    def _settle_prefill(self) -> None:
        """Release the pending prefill of the oldest picks that their replica's heartbeat now covers
        (module docstring). Pick order, stopping at the first not covered: O(1) amortised."""
        with self._lock:
            while self._unsettled:
                call = self._unsettled[0]
                ticket = call.ticket
                if ticket is not None and not ticket.prefill_done:
                    info = self._routing.replica(ticket.replica_id)
                    if info is not None and info.written_at < call.picked_at + _COVERED_AFTER_S:
                        return
                    self._routing.prefill_done(ticket)  # the pending prefill and the held speculative entries
                self._unsettled.popleft()

    def _refuse(self, call: _Call, code: grpc.StatusCode, message: str) -> ext_pb.ProcessingResponse:
        """The ImmediateResponse of a call the picker does not route: gRPC callers get ``code``,
        HTTP (OpenAI) callers the OpenAI error JSON with its HTTP status."""
        call.status, call.refusal = code.name, message
        http_status, body = error_response(code.name, message, chat=call.path == OPENAI_CHAT)
        if call.grpc:
            return protocol.immediate(http_status, code, message)
        return protocol.immediate(http_status, None, message, json.dumps(body).encode(),
                                  {"content-type": "application/json"})

    # -- the response ------------------------------------------------------------------------------
    def _trailers(self, call: _Call, trailers: dict[str, str]) -> ext_pb.ProcessingResponse:
        call.answered_trailers = True
        call.status = _status_name(trailers.get("grpc-status", "0"))
        raw = trailers.get(MD_CACHED_TOKENS, "")
        call.cached_tokens = int(raw) if raw.isdigit() else None
        d = call.decision
        return protocol.trailers_response(_routing(d) if d is not None and d.picked is not None else {})

    def _record(self, call: _Call, duration_s: float) -> None:
        metrics = self._routing.metrics
        d = call.decision
        if metrics is None or (d is None and not call.status):
            return
        if d is not None:
            metrics.record_decision(d, "routed" if d.picked is not None else "no_replica")
            if d.picked is not None and call.cached_tokens is not None:
                metrics.record_prediction(d.picked.replica_id, d.predicted_cached_tokens, call.cached_tokens)
        metrics.record_request(
            operation=call.operation, ttft_s=None, duration_s=duration_s,
            prompt_tokens=d.prompt_tokens if d is not None else None, completion_tokens=None,
            error_type=call.status if call.status not in ("", "OK") else None,
        )


def _routing(decision: Decision) -> dict[str, str]:
    """The pick as the client's routing trailers (the proxy's RoutingInfo)."""
    assert decision.picked is not None
    return {MD_REPLICA: decision.picked.replica_id, MD_PREDICTED: str(decision.predicted_cached_tokens)}


_STATUS_NAMES = {str(c.value[0]): c.name for c in grpc.StatusCode}


def _status_name(raw: str) -> str:
    """A grpc-status header's value (``"14"``) as the code's name (``"UNAVAILABLE"``)."""
    return _STATUS_NAMES.get(raw.strip(), "UNKNOWN")


def _pass_through(kind: str | None) -> ext_pb.ProcessingResponse:
    if kind == "response_body":
        return ext_pb.ProcessingResponse(response_body=ext_pb.BodyResponse())
    if kind == "request_trailers":
        return ext_pb.ProcessingResponse(request_trailers=ext_pb.TrailersResponse())
    return ext_pb.ProcessingResponse()


__all__ = ["EndpointPicker"]
