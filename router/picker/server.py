"""The endpoint picker's own gRPC server: ``envoy.service.ext_proc.v3.ExternalProcessor`` on the
router's ``picker_port`` (the Gateway API Inference Extension's EPP convention: ext_proc on a port
of its own, 9002), apart from the router's grpc.aio server.

Why a synchronous ``grpc.server`` on a thread pool: the pick is one message answered from memory,
and behind a real Envoy a thread pool answers it for less CPU per call than grpc.aio's event loop,
at about the same latency (docs/results.md: the hop to a second process costs the time, whatever
the framework). The cost is a thread per stream: an ext_proc stream lives
as long as its HTTP call (the picker counts the call in flight until it ends), so ``max_streams``
bounds the calls a router can have in flight through the gateway. The call past it is refused at
once by the picker itself (``EndpointPicker(max_calls=)``: RESOURCE_EXHAUSTED, HTTP 429, with a
message naming the limit), never queued behind a thread; ``REFUSAL_STREAMS`` more threads answer
those refusals, and past them the gRPC server refuses the stream (the gateway answers its client 503
/ UNAVAILABLE without a message, and counts it in ``ext_proc`` stats). Size it to the calls in
flight per router: every replica's running and waiting requests (threads blocked on a stream cost
memory, not CPU).

    PickerServer(picker, host, port, credentials, max_streams).start() -> bound port
    .stop(grace)   new streams refused; streams still open after ``grace`` s are cancelled
"""

from __future__ import annotations

import logging
from concurrent import futures

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc

from kvroute.tls import bind
from router.picker.servicer import EndpointPicker

log = logging.getLogger(__name__)

REFUSAL_STREAMS = 64
"""Threads beyond ``max_streams`` that answer the calls past the limit with the picker's refusal."""


class PickerServer:
    """``picker`` served on ``host:port`` (port 0: a free one) by ``max_streams`` threads.

    Raises (``start``): RuntimeError when the port cannot be bound.
    """

    def __init__(self, picker: EndpointPicker, host: str, port: int, credentials: grpc.ServerCredentials | None,
                 max_streams: int) -> None:
        if max_streams < 1:
            raise ValueError(f"picker_streams: at least 1, got {max_streams}")
        self.max_streams = max_streams
        picker.max_calls = max_streams
        threads = max_streams + REFUSAL_STREAMS
        self._pool = futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="picker")
        # maximum_concurrent_rpcs: a stream past the threads is refused, not queued behind the pool.
        self._server = grpc.server(self._pool, maximum_concurrent_rpcs=threads, options=[("grpc.so_reuseport", 0)])
        ext_grpc.add_ExternalProcessorServicer_to_server(picker, self._server)
        self._address = f"{host}:{port}"
        self._credentials = credentials
        self.port: int | None = None

    def start(self) -> int:
        self.port = bind(self._server, self._address, self._credentials)
        if not self.port:
            raise RuntimeError(f"picker_port: cannot bind {self._address}")
        self._server.start()
        return self.port

    def stop(self, grace: float = 1.0) -> None:
        """Blocks until stopped (at most ``grace`` s plus the cancelled handlers' unwinding)."""
        self._server.stop(grace).wait(grace + 5)
        self._pool.shutdown(wait=False, cancel_futures=True)


__all__ = ["REFUSAL_STREAMS", "PickerServer"]
