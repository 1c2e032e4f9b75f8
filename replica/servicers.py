"""The replica's gRPC servicers: ``kvroute.v1.GenerationService`` and ``kvroute.v1.ReplicaService``.

    GenerationService (text | token_ids | chat) ─┐
                                                 ├─▶ ReplicaFrontend (replica.frontend)
    ReplicaService (token_ids, Abort, GetLoad) ──┘

Each method hands its request to the frontend behind ``replica.wire.boundary``, where escaping
errors become statuses; nothing here decides a status or converts a message itself.
"""

from __future__ import annotations

from kvroute.v1 import generation_pb2 as gen_pb
from kvroute.v1 import generation_pb2_grpc as gen_grpc
from kvroute.v1 import replica_pb2 as rep_pb
from kvroute.v1 import replica_pb2_grpc as rep_grpc
from replica.frontend import ReplicaFrontend
from replica.wire import GENERATION_SERVICE, REPLICA_SERVICE, boundary


class GenerationServicer(gen_grpc.GenerationServiceServicer):
    """``kvroute.v1.GenerationService`` on a replica: text, token ids or chat."""

    def __init__(self, frontend: ReplicaFrontend) -> None:
        self._fe = frontend

    @staticmethod
    def _operation(request: gen_pb.GenerateRequest) -> str:
        return "chat" if request.WhichOneof("prompt") == "chat" else "text_completion"

    @boundary
    async def Generate(self, request, context):
        return await self._fe.unary(
            request, context, method=f"{GENERATION_SERVICE}/Generate", operation=self._operation(request)
        )

    @boundary
    def GenerateStream(self, request, context):
        return self._fe.stream(
            request, context, method=f"{GENERATION_SERVICE}/GenerateStream", operation=self._operation(request)
        )

    @boundary
    async def GetModelInfo(self, request, context):
        return self._fe.model_info()


class ReplicaServicer(rep_grpc.ReplicaServiceServicer):
    """``kvroute.v1.ReplicaService``: the router's view of this replica (token ids only)."""

    def __init__(self, frontend: ReplicaFrontend) -> None:
        self._fe = frontend

    @boundary
    async def Generate(self, request, context):
        return await self._fe.unary(request, context, method=f"{REPLICA_SERVICE}/Generate")

    @boundary
    def GenerateStream(self, request, context):
        return self._fe.stream(request, context, method=f"{REPLICA_SERVICE}/GenerateStream")

    @boundary
    async def Abort(self, request, context):
        return rep_pb.AbortResponse(found=self._fe.abort(request.request_id))

    @boundary
    async def GetLoad(self, request, context):
        return self._fe.load()

    @boundary
    async def GetModelInfo(self, request, context):
        return self._fe.model_info()

    @boundary
    async def RequestSnapshot(self, request, context):
        return rep_pb.RequestSnapshotResponse(seq=self._fe.request_snapshot())


__all__ = ["GenerationServicer", "ReplicaServicer"]
