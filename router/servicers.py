"""The router's gRPC servicers: GenerationService (routed to the replicas through the Proxy) and
RouterService (Score, SetPolicy). Statuses are decided in one place, :func:`router.proxy.classify_error`
behind ``error_boundary``."""

from __future__ import annotations

from collections.abc import Sequence

from kvroute.grpc_errors import error_boundary
from kvroute.v1 import generation_pb2_grpc as gen_grpc
from kvroute.v1 import router_pb2 as router_pb
from kvroute.v1 import router_pb2_grpc as router_grpc
from router.picker.servicer import EXT_PROC_SERVICE
from router.proxy import GENERATION_SERVICE, ROUTER_SERVICE, Proxy, classify_error

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
    """``kvroute.v1.RouterService``: ``Score`` (the decision as data) and ``SetPolicy``."""

    def __init__(self, proxy: Proxy) -> None:
        self._proxy = proxy

    @_boundary
    async def Score(self, request, context):
        return self._proxy.score(request)

    @_boundary
    async def SetPolicy(self, request, context):
        return router_pb.SetPolicyResponse(policy=self._proxy.set_policy(request.policy))


def service_names() -> Sequence[str]:
    """Full names of the services the router serves (health statuses, reflection)."""
    return (GENERATION_SERVICE, ROUTER_SERVICE, EXT_PROC_SERVICE)


__all__ = ["GenerationServicer", "RouterServicer", "service_names"]
