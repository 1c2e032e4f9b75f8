"""The router's OpenAI-compatible HTTP API (DESIGN.md §3.3, §5): ``kvroute.openai_http`` over the
routing service (router.routing) and the same :class:`~router.proxy.Proxy` the gRPC
GenerationService calls, so an HTTP request is tokenized, routed (speculative entries, in-flight
load) and forwarded exactly as a gRPC one: over gRPC to the picked replica, its deltas streamed
through. The serving replica and the
predicted cached tokens come back as the ``x-kvroute-replica`` / ``x-kvroute-predicted-cached-tokens``
response headers (the gRPC trailers' names); 503 when nothing is routable.

    HTTP body ─▶ kvroute.openai_api ─▶ GenerateRequest ─▶ Proxy.stream ─▶ ReplicaService.GenerateStream
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import grpc

from kvroute.openai_http import HttpCallContext, OpenAIApp
from kvroute.telemetry import Telemetry
from kvroute.v1 import generation_pb2 as gen_pb
from router.model_limits import UNBOUNDED
from router.proxy import Proxy
from router.routing import RoutingService, classify_error


class RouterBackend:
    """:class:`kvroute.openai_http.OpenAIBackend` of the router: ``routing`` for the model and its
    limits, ``proxy`` to forward. ``ready`` says whether the consumer has bootstrapped (the gRPC
    readiness)."""

    def __init__(self, routing: RoutingService, proxy: Proxy, ready: Callable[[], bool]) -> None:
        self._routing = routing
        self._proxy = proxy
        self._ready = ready

    def model(self) -> tuple[str, int]:
        """(the model folder's name, the max_model_len requests are validated against:
        ``RoutingService.model_limits``, 0 when neither the replicas nor the folder give one)."""
        max_model_len = self._routing.model_limits()[1]
        return self._routing.tokenizer.model_name, max_model_len if max_model_len != UNBOUNDED else 0

    def stream(self, request: gen_pb.GenerateRequest, context: HttpCallContext, *, method: str, operation: str
               ) -> AsyncIterator[gen_pb.GenerateResponse]:
        return self._proxy.stream(request, context, method=method)  # type: ignore[arg-type]

    def classify(self, exc: BaseException) -> tuple[grpc.StatusCode, str] | None:
        return classify_error(exc)

    def unready_reason(self) -> str | None:
        if not self._ready():
            return "router is starting: the event consumer has not bootstrapped yet"
        if not self._routing.routable():
            return "no routable replica"
        return None


def router_http_app(routing: RoutingService, proxy: Proxy, ready: Callable[[], bool],
                    telemetry: Telemetry | None = None) -> OpenAIApp:
    """The HTTP app of a router routing with ``routing`` and forwarding through ``proxy``
    (``telemetry``'s registry: ``GET /metrics``)."""
    return OpenAIApp(RouterBackend(routing, proxy, ready), telemetry=telemetry)


__all__ = ["RouterBackend", "router_http_app"]
