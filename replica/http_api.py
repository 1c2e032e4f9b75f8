"""The replica's OpenAI-compatible HTTP API (DESIGN.md §3.3): ``kvroute.openai_http`` over the
same :class:`~replica.frontend.ReplicaFrontend` the gRPC servicers call, so a request gets the
same validation, admission control (429 when the waiting queue is full), cached-token usage and
cancellation (a client disconnect aborts the engine request and frees its blocks).

    HTTP body ─▶ kvroute.openai_api ─▶ GenerateRequest ─▶ ReplicaFrontend.stream ─▶ deltas ─▶ JSON / SSE
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from kvroute.grpc_errors import RpcError
from kvroute.openai_http import HttpCallContext, OpenAIApp
from kvroute.telemetry import Telemetry
from kvroute.v1 import generation_pb2 as gen_pb
from replica.frontend import ReplicaFrontend
from replica.wire import classify_error


class ReplicaBackend:
    """:class:`kvroute.openai_http.OpenAIBackend` of one replica's frontend."""

    def __init__(self, frontend: ReplicaFrontend) -> None:
        self._fe = frontend

    def model(self) -> tuple[str, int]:
        """(served model, max_model_len). Raises RpcError UNAVAILABLE while the model loads."""
        if self._fe.info is None:
            raise RpcError(grpc.StatusCode.UNAVAILABLE, "replica is loading its model")
        return self._fe.info.model, self._fe.info.max_model_len

    def stream(self, request: gen_pb.GenerateRequest, context: HttpCallContext, *, method: str, operation: str
               ) -> AsyncIterator[gen_pb.GenerateResponse]:
        return self._fe.stream(request, context, method=method, operation=operation)  # type: ignore[arg-type]

    def classify(self, exc: BaseException) -> tuple[grpc.StatusCode, str] | None:
        return classify_error(exc)

    def unready_reason(self) -> str | None:
        try:
            self._fe.check_serving()
        except Exception as exc:  # noqa: BLE001 - the reason is the answer
            return str(exc)
        return None


def replica_http_app(frontend: ReplicaFrontend, telemetry: Telemetry | None = None) -> OpenAIApp:
    """The HTTP app of a replica serving ``frontend`` (``telemetry``'s registry: ``GET /metrics``)."""
    return OpenAIApp(ReplicaBackend(frontend), telemetry=telemetry)


__all__ = ["ReplicaBackend", "replica_http_app"]
