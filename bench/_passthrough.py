"""The bare pass-through proxies ``bench/router.py --bare`` measures next to the router: one server
handler forwarding ``GenerationService.GenerateStream`` to a replica's ``ReplicaService.GenerateStream``
and nothing else, in several designs -- the floor of each kind of Python gRPC hop on the machine.

Run as a child process by ``bench/router.py --passthrough PORT UPSTREAM --variant VARIANT``.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvroute.v1 import generation_pb2 as gen_pb
from router.proxy import GENERATION_SERVICE

# Bare pass-through designs (``--passthrough PORT UPSTREAM VARIANT``): the floor of each kind of Python
# gRPC hop. "aio": grpc.aio server + grpc.aio client (the router's design); "sync": grpc.server on a
# ThreadPoolExecutor + a sync client stub; "-st": the sync client channel with
# grpc.experimental.ChannelOptions.SingleThreadedUnaryStream (the handler thread polls the call itself
# instead of a channel thread handing each message over); "-bytes": responses forwarded as raw bytes (no
# response (de)serialization in the hop; the request is still parsed, as a router must).
BARE_VARIANTS = ("aio", "aio-bytes", "sync", "sync-st", "sync-st-bytes")
REPLICA_STREAM = "/kvroute.v1.ReplicaService/GenerateStream"


def passthrough(port: int, upstream: str, variant: str = "aio") -> None:
    """A bare pass-through proxy of one design (BARE_VARIANTS), until killed: one handler forwarding
    GenerationService.GenerateStream to the replica's ReplicaService.GenerateStream, nothing else."""
    import asyncio
    from concurrent import futures

    import grpc.experimental
    from grpc_health.v1 import health

    from kvroute.v1 import replica_pb2 as rep_pb

    parts = set(variant.split("-"))
    raw = "bytes" in parts
    serialize = rep_pb.ReplicaGenerateRequest.SerializeToString
    deserialize = None if raw else gen_pb.GenerateResponse.FromString

    def upstream_request(request: gen_pb.GenerateRequest) -> rep_pb.ReplicaGenerateRequest:
        return rep_pb.ReplicaGenerateRequest(token_ids=request.token_ids.ids, sampling=request.sampling)

    def handlers(handle) -> grpc.GenericRpcHandler:
        method = grpc.unary_stream_rpc_method_handler(
            handle, request_deserializer=gen_pb.GenerateRequest.FromString,
            response_serializer=None if raw else gen_pb.GenerateResponse.SerializeToString,
        )
        return grpc.method_handlers_generic_handler(GENERATION_SERVICE, {"GenerateStream": method})

    if "sync" in parts:
        options = [(grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1)] if "st" in parts else []
        channel = grpc.insecure_channel(upstream, options=options)  # referenced: a collected channel closes
        call = channel.unary_stream(REPLICA_STREAM, serialize, deserialize)

        def forward(request, context):
            yield from call(upstream_request(request), timeout=context.time_remaining())

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        server.add_generic_rpc_handlers((handlers(forward),))
        checks = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(checks, server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        checks.set("readiness", health_pb2.HealthCheckResponse.SERVING)
        server.wait_for_termination()
        return

    async def serve() -> None:
        call = grpc.aio.insecure_channel(upstream).unary_stream(REPLICA_STREAM, serialize, deserialize)

        async def forward(request, context):
            async for r in call(upstream_request(request), timeout=context.time_remaining()):
                yield r

        server = grpc.aio.server()
        server.add_generic_rpc_handlers((handlers(forward),))
        checks = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(checks, server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await checks.set("readiness", health_pb2.HealthCheckResponse.SERVING)
        await server.wait_for_termination()

    asyncio.run(serve())
