"""The router's gRPC servicers: GenerationService (routed to the replicas through the Proxy) and
RouterService (Score, SetPolicy). Statuses are decided in one place, :func:`router.routing.classify_error`
behind ``error_boundary``."""

from __future__ import annotations

import hmac
from collections.abc import Sequence

import grpc

from kvroute.grpc_errors import RpcError, error_boundary
from kvroute.v1 import generation_pb2_grpc as gen_grpc
from kvroute.v1 import router_pb2 as router_pb
from kvroute.v1 import router_pb2_grpc as router_grpc
from router.proxy import GENERATION_SERVICE, ROUTER_SERVICE, Proxy
from router.routing import RoutingService, classify_error

_boundary = error_boundary(classify_error)


class GenerationServicer(gen_grpc.GenerationServiceServicer):
    """``kvroute.v1.GenerationService`` on the router: routed to the replicas."""

    def __init__(self, proxy: Proxy) -> None:
        self._proxy = proxy

    @_boundary
    async def Generate(self, request, context):
        return await self._proxy.unary(request, context, method=f"{GENERATION_SERVICE}/Generate")

    @_boundary
    def GenerateStream(self, request, context):
        return self._proxy.stream(request, context, method=f"{GENERATION_SERVICE}/GenerateStream")

    @_boundary
    async def GetModelInfo(self, request, context):
        return await self._proxy.model_info()


class RouterServicer(router_grpc.RouterServiceServicer):
    """``kvroute.v1.RouterService``: ``Score`` (the decision as data) and ``SetPolicy``.

    ``SetPolicy`` changes routing for every client: PERMISSION_DENIED unless ``admin_token`` is set
    (settings ``admin_token`` / ``admin_token_file``), then UNAUTHENTICATED unless the call carries
    the metadata ``authorization: Bearer <admin_token>``.
    """

    def __init__(self, routing: RoutingService, admin_token: str | None = None) -> None:
        self._routing = routing
        self._expected = f"Bearer {admin_token}".encode() if admin_token else None

    @_boundary
    async def Score(self, request, context):
        return self._routing.score(request)

    def _check_admin(self, context) -> None:
        if self._expected is None:
            raise RpcError(grpc.StatusCode.PERMISSION_DENIED,
                           "SetPolicy is off on this router: start it with admin_token_file (or KVROUTE_ADMIN_TOKEN)")
        given = next((v for k, v in context.invocation_metadata() if k == "authorization"), "")
        if not hmac.compare_digest(given.encode() if isinstance(given, str) else given, self._expected):
            raise RpcError(grpc.StatusCode.UNAUTHENTICATED,
                           "SetPolicy: metadata 'authorization: Bearer <admin token>' missing or wrong")

    @_boundary
    async def SetPolicy(self, request, context):
        self._check_admin(context)
        return router_pb.SetPolicyResponse(policy=self._routing.set_policy(request.policy))


def service_names() -> Sequence[str]:
    """Full names of the services the router's gRPC port serves (health statuses, reflection); the
    endpoint picker has its own port (router.picker.server)."""
    return (GENERATION_SERVICE, ROUTER_SERVICE)


__all__ = ["GenerationServicer", "RouterServicer", "service_names"]
