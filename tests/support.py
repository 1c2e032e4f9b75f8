"""Helpers the test modules share (``from tests.support import ...``)."""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest

T = TypeVar("T")


def wait_for(pred: Callable[[], T], timeout: float = 10.0, what: str = "condition", *, interval: float = 0.02) -> T:
    """Poll ``pred()`` until it returns a truthy value, and return that value.

    Raises:
        AssertionError: not within ``timeout`` seconds (the message names ``what`` and the last value).
    """
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout}s (last value {value!r})")
        time.sleep(interval)


def replica_idle(rep) -> bool:
    """Nothing running or waiting on the replica behind the ``ReplicaServiceStub`` ``rep``, and
    no KV block in use (``GetLoad``)."""
    from kvroute.v1 import replica_pb2 as rep_pb

    load = rep.GetLoad(rep_pb.GetLoadRequest())
    return load.running == 0 and load.waiting == 0 and load.kv_usage == 0.0


def concurrent_stream_outcomes(target: str, n: int, max_tokens: int = 4) -> dict[str, int]:
    """Open ``n`` ReplicaService.GenerateStream calls at once against ``target`` (9-token prompts,
    greedy, ``max_tokens``) and count the outcomes: "OK" for a stream that delivered exactly
    ``max_tokens`` tokens and ended with FINISH_REASON_LENGTH, else the status code's name."""
    import asyncio

    import grpc

    from kvroute.v1 import generation_pb2 as gen_pb
    from kvroute.v1 import replica_pb2 as rep_pb
    from kvroute.v1 import replica_pb2_grpc as rep_grpc

    async def run() -> list[str]:
        async with grpc.aio.insecure_channel(target) as ch:
            stub = rep_grpc.ReplicaServiceStub(ch)

            async def one(i: int) -> str:
                req = rep_pb.ReplicaGenerateRequest(
                    token_ids=[1 + i % 400, 2, 3, 4, 5, 6, 7, 8, 9],
                    sampling=gen_pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                )
                try:
                    deltas = [d async for d in stub.GenerateStream(req)]
                except grpc.aio.AioRpcError as e:
                    return e.code().name
                assert sum(len(d.token_ids) for d in deltas) == max_tokens
                assert deltas[-1].finish_reason == gen_pb.FINISH_REASON_LENGTH
                return "OK"

            return await asyncio.gather(*(one(i) for i in range(n)))

    outcomes = asyncio.run(run())
    return {k: outcomes.count(k) for k in set(outcomes)}


NUM_SPECIAL = 5  # the default model's special tokens are its last 5 ids: never in random prompts


def random_tokens(n: int, seed: int, vocab: int = 529) -> list[int]:
    """``n`` token ids drawn by torch's generator from ``seed`` (reproducible), below the default
    model's special tokens."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(vocab - NUM_SPECIAL, (n,), generator=gen).tolist()


def make_cpu_engine(model_dir, *, num_blocks: int, block_size: int = 16, **overrides):
    """An ``LLMEngine`` on CPU with one torch thread and ``num_blocks`` KV blocks."""
    from replica.engine.config import EngineConfig
    from replica.engine.engine import LLMEngine

    cfg = dict(device="cpu", block_size=block_size, num_blocks=num_blocks, torch_threads=1)
    cfg.update(overrides)
    return LLMEngine(model_dir, EngineConfig(**cfg))


def started_stream(gen, request, n: int, timeout: float | None = None):
    """``gen.GenerateStream(request, timeout=timeout)`` after its first ``n`` deltas, each of which
    carried exactly one token (the call is then in flight on a replica)."""
    stream = gen.GenerateStream(request, timeout=timeout)
    got = [next(stream) for _ in range(n)]
    assert all(len(d.token_ids) == 1 for d in got)
    return stream


def deltas_before_deadline(stream) -> int:
    """Consume a server stream that must fail with DEADLINE_EXCEEDED; returns how many messages
    arrived before it did."""
    import grpc
    import pytest

    received = 0
    with pytest.raises(grpc.RpcError) as err:
        for _ in stream:
            received += 1
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    return received


def abort_mid_stream(gen, rep, request_id: str, sampling) -> list:
    """Start a public stream with ``request_id``, ``Abort`` it after its first delta (found), and
    return the rest of the stream, which ends with FINISH_REASON_ABORT; a second ``Abort`` finds
    nothing."""
    from kvroute.v1 import generation_pb2 as gen_pb
    from kvroute.v1 import replica_pb2 as rep_pb

    stream = gen.GenerateStream(gen_pb.GenerateRequest(request_id=request_id, text="abort me", sampling=sampling))
    next(stream)
    assert rep.Abort(rep_pb.AbortRequest(request_id=request_id)).found
    rest = list(stream)
    assert rest[-1].finish_reason == gen_pb.FINISH_REASON_ABORT
    assert not rep.Abort(rep_pb.AbortRequest(request_id=request_id)).found
    return rest


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, exited but not reaped, does not)."""
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0): look at its state.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def assert_duplicate_request_id_refused(gen, rep, request_id: str, sampling) -> None:
    """While a public stream with ``request_id`` is in flight, a ReplicaService call reusing the id
    fails INVALID_ARGUMENT naming ``request_id``; the stream is then cancelled and the replica drains."""
    import grpc
    import pytest

    from kvroute.v1 import generation_pb2 as gen_pb
    from kvroute.v1 import replica_pb2 as rep_pb

    stream = gen.GenerateStream(gen_pb.GenerateRequest(request_id=request_id, text="a long one", sampling=sampling))
    next(stream)
    try:
        with pytest.raises(grpc.RpcError) as err:
            rep.Generate(rep_pb.ReplicaGenerateRequest(request_id=request_id, token_ids=[1, 2, 3]))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith("request_id: ")
    finally:
        stream.cancel()
    wait_for(lambda: replica_idle(rep))


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    """Autouse, per module: torch on one intra-op thread while the module's tests run, the previous
    count restored after. A test module opts in with ``from tests.support import one_torch_thread``.
    Their tensors are tiny: with two OpenMP threads on a busy 2-core machine every op waits on a
    barrier (measured 5 s vs 0.1 s for a decode test)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# -- Redis: a server, and a reader of what replicas wrote to it ------------------------------------------
@pytest.fixture
def redis_server():
    """A fresh embedded redis-server for one test. A test module uses it by importing it, under the
    name its tests take (``from tests.support import redis_server as server``)."""
    from kvroute_tools.redis_server import RedisServer

    with RedisServer() as s:
        yield s


@pytest.fixture
def redis_layout():
    """The key layout of namespace ``test`` (each test has its own server: no two tests share keys)."""
    from kvroute.redis_layout import RedisLayout

    return RedisLayout(namespace="test")


@pytest.fixture
def redis_client(server):
    """A redis-py client of the test's ``server`` fixture (bytes replies)."""
    import redis

    client = redis.Redis.from_url(server.url)
    yield client
    client.close()


def replica_entries(r, layout, replica_id: str) -> list[tuple[bytes, dict]]:
    """(entry id, fields) of ``replica_id``'s entries in its event stream, in stream order."""
    from kvroute.redis_layout import F_REPLICA_ID

    return [(eid, f) for eid, f in r.xrange(layout.events_stream(replica_id)) if f[F_REPLICA_ID].decode() == replica_id]


def read_entries(r, layout, replica_id: str) -> list[tuple[int, int, list]]:
    """(epoch, seq, events) of every stream entry of ``replica_id``, in stream order."""
    from kvroute.events import decode_batch
    from kvroute.redis_layout import F_BATCH, F_EPOCH, F_SEQ

    return [(int(f[F_EPOCH]), int(f[F_SEQ]), decode_batch(f[F_BATCH])[1]) for _eid, f in replica_entries(r, layout, replica_id)]


def read_snapshot(r, layout, replica_id: str):
    """``replica_id``'s CacheSnapshot in Redis (kvroute.snapshot). AssertionError when there is none."""
    from kvroute.snapshot import decode_snapshot

    data = r.get(layout.snapshot_key(replica_id))
    assert data is not None, "no snapshot in Redis"
    return decode_snapshot(data)


def replay(r, layout, replica_id: str, *, from_snapshot: bool):
    """A reader's ReplicaCacheState of ``replica_id``: the stream from its start (or from the
    snapshot), resyncing from the snapshot on a gap."""
    from kvroute.ordering import BatchResult, ReplicaCacheState

    state = ReplicaCacheState()
    if from_snapshot:
        state.load_snapshot(read_snapshot(r, layout, replica_id))
    for epoch, seq, events in read_entries(r, layout, replica_id):
        if state.apply_batch(epoch, seq, events) is BatchResult.GAP:
            snap = read_snapshot(r, layout, replica_id)
            assert (snap.epoch, snap.seq) >= (epoch, seq - 1), "the snapshot does not cover the gap"
            state.load_snapshot(snap)
            assert state.apply_batch(epoch, seq, events) is not BatchResult.GAP
    return state


# -- the router's consumer against replicas without an engine ----------------------------------------------
FAKE_LOAD_FIELDS = dict(free_blocks=40, running=2, waiting=1, usage=0.375, queued_prefill_tokens=96)
"""The load every FakeReplica reports (kvroute.heartbeat.EngineLoad's fields)."""


def engine_info(identity: tuple[str, str, int], num_blocks: int = 64):
    """A small engine's EngineInfo with the hash triple ``identity`` (algorithm, seed digest, block_size)."""
    from kvroute.engine_info import EngineInfo

    algorithm, seed_digest, block_size = identity
    return EngineInfo(model="tiny", vocab_size=500, max_model_len=1024, block_size=block_size,
                      num_blocks=num_blocks, hash_algorithm=algorithm, hash_seed_digest=seed_digest)


class FakeReplica:
    """A replica without an engine: a real RedisEventPublisher fed random events; ``truth`` is its
    cached set (a ReplicaCacheState fed the same events). ``identity`` overrides EngineInfo fields
    of the default (the router's hash triple)."""

    def __init__(self, server, layout, replica_id: str, *, port: int = 50051, seed: int = 0,
                 identity: dict | None = None, **publisher_kw):
        import dataclasses

        from kvroute.hashing import BlockHasher
        from kvroute.heartbeat import EngineLoad
        from kvroute.ordering import ReplicaCacheState
        from replica.publisher import RedisEventPublisher

        self.replica_id = replica_id
        self.rng = random.Random(seed)
        self.truth = ReplicaCacheState()
        self.load = EngineLoad(**FAKE_LOAD_FIELDS)
        info = dataclasses.replace(engine_info(BlockHasher().identity), **(identity or {}))
        publisher_kw.setdefault("heartbeat_interval", 0.2)
        publisher_kw.setdefault("snapshot_interval", 3600)  # snapshots only at start and on request
        self.pub = RedisEventPublisher(server.url, layout, replica_id, info, f"127.0.0.1:{port}", **publisher_kw)
        self.pub.start()

    def random_events(self) -> list:
        from kvroute.events import CPU, GPU, BlockRemoved, BlockStored

        held = list(self.truth.as_multiset()[GPU].elements())
        events: list = []
        if held and self.rng.random() < 0.6:  # evict one block to the CPU tier
            victim = self.rng.choice(held)
            events += [BlockRemoved((victim,), GPU), BlockStored((victim,), None, (), 16, None, CPU, None)]
        if held and self.rng.random() < 0.2:  # a second copy of a cached block
            events.append(BlockStored((self.rng.choice(held),), None, (), 16))
        cpu = list(self.truth.as_multiset()[CPU].elements())
        if cpu and self.rng.random() < 0.3:
            events.append(BlockRemoved((self.rng.choice(cpu),), CPU))
        events.append(BlockStored(tuple(self.rng.getrandbits(64) for _ in range(4)), None, (), 16))
        return events

    def step(self, events: list | None = None) -> None:
        """One engine step with ``events`` (default: random ones)."""
        events = self.random_events() if events is None else events
        self.truth.apply_events(events)
        self.pub.on_step(events, self.load, self.snapshot)

    def steps(self, n: int) -> None:
        for _ in range(n):
            self.step()

    def idle(self) -> None:
        """An idle engine tick: no events, but a wanted snapshot is taken."""
        self.pub.on_step([], self.load, self.snapshot)

    def snapshot(self) -> dict[str, list[int]]:
        return {m: list(c.elements()) for m, c in self.truth.as_multiset().items()}

    def cached(self) -> dict[str, dict[int, int]]:
        return {m: dict(c) for m, c in self.truth.as_multiset().items()}

    def wait_written(self) -> None:
        wait_for(lambda: self.idle() or self.pub.last_seq_written == self.pub.last_seq, what="batches written")

    def close(self) -> None:
        self.pub.close()


@pytest.fixture
def fake_replicas(server, layout) -> Iterator[Callable[..., FakeReplica]]:
    """``make(replica_id, **kw)``: a started FakeReplica on the test's ``server`` and ``layout``
    (ports 50051, 50052, ... and seeds 0, 1, ... in order of making); all closed at the end."""
    made: list[FakeReplica] = []

    def make(replica_id: str, **kw) -> FakeReplica:
        kw.setdefault("port", 50051 + len(made))
        kw.setdefault("seed", len(made))
        rep = FakeReplica(server, layout, replica_id, **kw)
        made.append(rep)
        return rep

    yield make
    for rep in made:
        rep.close()


@contextlib.contextmanager
def running_consumer(server, layout, registry=None, **kw) -> Iterator[Any]:
    """A started EventConsumer (a fresh BlockIndex without speculative entries; ``registry``
    default: the router's hash triple, redis discovery) that has bootstrapped; stopped at the end."""
    from kvroute.hashing import BlockHasher
    from router.consumer import EventConsumer
    from router.index import BlockIndex
    from router.registry import ReplicaRegistry

    registry = registry or ReplicaRegistry(BlockHasher().identity, "redis")
    kw.setdefault("heartbeat_poll_interval", 0.1)
    kw.setdefault("block_ms", 50)
    consumer = EventConsumer(server.url, layout, BlockIndex(speculative_ttl=0), registry, **kw)
    consumer.start()
    try:
        assert consumer.wait_ready(5), "the consumer did not bootstrap"
        yield consumer
    finally:
        consumer.stop()


def indexed(consumer, replica_id: str) -> dict[str, dict[int, int]]:
    """The consumer's index entries of ``replica_id``: medium -> {hash: copies}."""
    from kvroute.events import MEDIA

    with consumer.index_lock:
        return {m: consumer.index.cached_set(replica_id, m) for m in MEDIA}


def in_sync(consumer, replicas: list[FakeReplica]) -> bool:
    """The index holds exactly the replicas' cached multisets, per medium, and nobody else; the
    registry has their heartbeats. Ticks each replica's idle hook first (snapshot requests)."""
    for rep in replicas:
        rep.idle()
    for rep in replicas:
        info = consumer.registry.get(rep.replica_id)
        if info is None or info.epoch != rep.pub.epoch:
            return False
    if any(indexed(consumer, rep.replica_id) != rep.cached() for rep in replicas):
        return False
    expected = {rep.replica_id for rep in replicas}
    return all(r in expected for r, n in consumer.entries().items() if n)


SYNC_TIMEOUT = 2.0
"""How soon after any fault the consumer's index must match the replicas again (seconds)."""


def wait_synced(consumer, replicas: list[FakeReplica], timeout: float = SYNC_TIMEOUT,
                what: str = "the index to match the replicas") -> None:
    wait_for(lambda: in_sync(consumer, replicas), timeout, what)
