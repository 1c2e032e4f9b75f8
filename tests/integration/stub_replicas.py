"""Stub replicas for routing tests: a real gRPC server that answers ``GenerationService`` (what a
gateway forwards) and ``ReplicaService`` (what the proxy calls) ``GenerateStream`` with one final
message naming itself, plus a real :class:`RedisEventPublisher` that heartbeats the load a test sets
and publishes the blocks a test says it holds. No engine: the router's decisions are the subject.

``hold()`` keeps every new call open (no byte sent) until ``release()``: a routed request then stays
in flight with its prompt unprefilled, as the hand-worked cases count it.
"""

from __future__ import annotations

import asyncio
import threading

import grpc

from kvroute.engine_info import EngineInfo
from kvroute.events import GPU, BlockStored
from kvroute.hashing import NO_KEYS, BlockHasher, BlockHashKeys
from kvroute.heartbeat import EngineLoad
from kvroute.process import BackgroundServer
from kvroute.prompt import DEFAULT_MODEL_DIRNAME
from kvroute.redis_layout import RedisLayout
from kvroute.responses import MD_CACHED_TOKENS
from kvroute.v1 import generation_pb2 as gen_pb
from kvroute.v1 import generation_pb2_grpc as gen_grpc
from kvroute.v1 import replica_pb2_grpc as rep_grpc
from replica.publisher import RedisEventPublisher

IDLE = EngineLoad(free_blocks=999, running=0, waiting=0, usage=0.0, queued_prefill_tokens=0)


class _Server:
    def __init__(self, replica_id: str) -> None:
        self.replica_id = replica_id
        self.calls: list[str] = []  # request ids, in arrival order
        self.open = 0
        self.release_event: asyncio.Event | None = None
        self.refusal: tuple[grpc.StatusCode, str] | None = None  # set: every call is refused with it
        self.port = 0
        self._server: grpc.aio.Server | None = None

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def start(self) -> None:
        self.release_event = asyncio.Event()
        self.release_event.set()
        self._server = grpc.aio.server()
        stub = self

        class Gen(gen_grpc.GenerationServiceServicer):
            async def GenerateStream(self, request, context):
                async for m in stub.answer(request, context):
                    yield m

        class Rep(rep_grpc.ReplicaServiceServicer):
            async def GenerateStream(self, request, context):
                async for m in stub.answer(request, context):
                    yield m

        gen_grpc.add_GenerationServiceServicer_to_server(Gen(), self._server)
        rep_grpc.add_ReplicaServiceServicer_to_server(Rep(), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()

    async def answer(self, request, context):
        self.calls.append(request.request_id)
        self.open += 1
        try:
            if self.refusal is not None:
                await context.abort(*self.refusal)
            await self.release_event.wait()
            context.set_trailing_metadata(((MD_CACHED_TOKENS, "0"),))
            yield gen_pb.GenerateResponse(request_id=request.request_id, text=self.replica_id, token_ids=[1],
                                          finish_reason=gen_pb.FINISH_REASON_LENGTH,
                                          usage=gen_pb.Usage(prompt_tokens=1, completion_tokens=1))
        finally:
            self.open -= 1

    async def stop(self, grace: float) -> None:
        if self._server is not None:
            await self._server.stop(grace)


class StubReplica(BackgroundServer):
    """One stub replica (module docstring) heartbeating into ``redis_url`` as ``replica_id``."""

    def __init__(self, replica_id: str, redis_url: str, hasher: BlockHasher, max_waiting: int = 0,
                 model: str = DEFAULT_MODEL_DIRNAME) -> None:
        self._start(lambda: _Server(replica_id), f"stub-{replica_id}", lambda s: self.run(s.start()))
        self.replica_id = replica_id
        self.hasher = hasher
        algorithm, digest, block_size = hasher.identity
        info = EngineInfo(model=model, vocab_size=32000, max_model_len=4096, block_size=block_size, num_blocks=1000,
                          hash_algorithm=algorithm, hash_seed_digest=digest)
        self.publisher = RedisEventPublisher(redis_url, RedisLayout(), replica_id, info, self.target,
                                             heartbeat_interval=0.1, max_waiting=max_waiting,
                                             # loads change within 0.1 s; a stall of the test process
                                             # (GC, a busy machine) must not expire a stub (it did at 0.3 s)
                                             heartbeat_ttl=5.0)
        self.publisher.start()
        self._held: list[int] = []
        self._lock = threading.Lock()
        self.set_load(IDLE)

    @property
    def calls(self) -> list[str]:
        return self.server.calls

    def set_load(self, load: EngineLoad) -> None:
        self.publisher.on_step([], load, self._snapshot)
        self._load = load

    def store(self, token_ids, cache_salt: str | None = None, blocks: int | None = None) -> None:
        """Publish the first ``blocks`` full blocks of ``token_ids`` as cached on this replica."""
        hashes = self.hasher.event_ints(token_ids, BlockHashKeys(cache_salt=cache_salt) if cache_salt else NO_KEYS)
        hashes = tuple(hashes[:blocks] if blocks is not None else hashes)
        with self._lock:
            self._held.extend(hashes)
        self.publisher.on_step([BlockStored(hashes, None, (), self.hasher.block_size)], self._load, self._snapshot)

    def _snapshot(self):
        with self._lock:
            return {GPU: list(self._held)}

    def refuse(self, refusal: tuple[grpc.StatusCode, str] | None) -> None:
        """Refuse every call with ``(code, message)`` from now on (None: answer again)."""
        self.server.refusal = refusal

    def hold(self) -> None:
        self.loop.call_soon_threadsafe(self.server.release_event.clear)

    def release(self) -> None:
        self.loop.call_soon_threadsafe(self.server.release_event.set)

    def close(self, grace: float = 0.2) -> None:
        self.release()
        self.publisher.close()
        super().close(grace)
