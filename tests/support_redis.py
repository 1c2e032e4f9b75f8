"""Test helpers for the KV-event path (``from tests.support_redis import ...``): a throwaway
redis-server, readers of what replicas wrote to it, replicas without an engine (a real
RedisEventPublisher fed random events), and a running router consumer with its sync checks,
in this process or in a child one (``ConsumerProcess``: a router a test can freeze).

A module uses a fixture here by assigning it to the name its tests take (``server =
support_redis.redis_server``).

``python -m tests.support_redis REDIS_URL NAMESPACE SHARDS`` is ConsumerProcess's child."""

from __future__ import annotations

import contextlib
import json
import os
import random
import select
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import wait_for


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
    from kvroute.prompt import DEFAULT_MODEL_DIRNAME

    algorithm, seed_digest, block_size = identity
    return EngineInfo(model=DEFAULT_MODEL_DIRNAME, vocab_size=500, max_model_len=1024, block_size=block_size,
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


def consumer_view(consumer) -> dict[str, Any]:
    """What a running consumer knows, as values: ``epochs`` (replica -> its registered epoch),
    ``entries`` (consumer.entries()), ``index`` (replica -> :func:`indexed`), ``stats``."""
    entries = consumer.entries()
    return {"epochs": {i.replica_id: i.epoch for i in consumer.registry.all()}, "entries": entries,
            "index": {rid: indexed(consumer, rid) for rid in entries},
            "stats": {k: v for k, v in consumer.stats().items() if k != "entries"}}


def in_sync(consumer, replicas: list[FakeReplica]) -> bool:
    """The index holds exactly the replicas' cached multisets, per medium, and nobody else; the
    registry has their heartbeats. Ticks each replica's idle hook first (snapshot requests).
    ``consumer``: an EventConsumer, or a ConsumerProcess."""
    for rep in replicas:
        rep.idle()
    view = consumer.view() if isinstance(consumer, ConsumerProcess) else consumer_view(consumer)
    if any(view["epochs"].get(rep.replica_id) != rep.pub.epoch for rep in replicas):
        return False
    if any(view["index"].get(rep.replica_id) != rep.cached() for rep in replicas):
        return False
    expected = {rep.replica_id for rep in replicas}
    return all(r in expected for r, n in view["entries"].items() if n)


class ConsumerProcess:
    """A running consumer (:func:`running_consumer`) in a child process of its own, so that a
    test can freeze it (``pause``: SIGSTOP, ``resume``: SIGCONT) like a stalled router; ``view()``
    is its :func:`consumer_view` (``wait_synced`` takes it). Started when made, ready (bootstrapped)
    when the constructor returns.

    Raises:
        AssertionError: the child did not answer within ``timeout`` seconds.
    """

    def __init__(self, redis_url: str, layout, timeout: float = 15.0):
        self.timeout = timeout
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support_redis", redis_url, layout.namespace, str(layout.num_shards)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1])
        assert self._line() == "ready", "the consumer process did not bootstrap"

    def _line(self) -> str:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], self.timeout)
        assert ready, f"the consumer process said nothing within {self.timeout}s"
        line = self.proc.stdout.readline()
        assert line, f"the consumer process exited ({self.proc.poll()})"
        return line.strip()

    def view(self) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("view\n")
        self.proc.stdin.flush()
        view = json.loads(self._line())
        view["index"] = {rid: {m: {int(h): n for h, n in held.items()} for m, held in media.items()}
                         for rid, media in view["index"].items()}
        return view

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        self.resume()
        with contextlib.suppress(OSError):
            self.proc.stdin.close()  # the child stops its consumer and exits
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> ConsumerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _consumer_child(redis_url: str, namespace: str, shards: str) -> None:
    """ConsumerProcess's child: a running consumer; says ``ready``, then answers each ``view``
    line on stdin with its view as one JSON line; stops at the end of stdin."""
    import logging

    from kvroute.redis_layout import RedisLayout

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    server = type("Server", (), {"url": redis_url})()
    with running_consumer(server, RedisLayout(namespace, int(shards))) as consumer:
        print("ready", flush=True)
        for line in sys.stdin:
            if line.strip() == "view":
                print(json.dumps(consumer_view(consumer)), flush=True)


SYNC_TIMEOUT = 2.0
"""How soon after any fault the consumer's index must match the replicas again (seconds)."""


def wait_synced(consumer, replicas: list[FakeReplica], timeout: float = SYNC_TIMEOUT,
                what: str = "the index to match the replicas") -> None:
    wait_for(lambda: in_sync(consumer, replicas), timeout, what)


@contextlib.contextmanager
def unreachable_replica(redis_url: str, replica_id: str, ids: list[int], *, layout: Any = None,
                 max_model_len: int = 2048) -> Iterator[Any]:
    """A replica of the default model that published the full blocks of ``ids`` (block_size 16)
    and heartbeats at an address nobody listens on: the router's best pick for ``ids`` until it
    is closed and its heartbeat expires, and a call routed there fails UNAVAILABLE before its
    first token (the router retries it elsewhere). Yields the RedisEventPublisher."""
    from kvroute.engine_info import EngineInfo
    from kvroute.events import GPU, BlockStored
    from kvroute.hashing import BlockHasher
    from kvroute.heartbeat import EngineLoad
    from kvroute.redis_layout import RedisLayout
    from kvroute_tools.redis_server import free_port
    from replica.publisher import RedisEventPublisher

    hasher = BlockHasher()
    algorithm, digest, block_size = hasher.identity
    info = EngineInfo(model="kvroute-tiny-llama", vocab_size=529, max_model_len=max_model_len, block_size=block_size,
                      num_blocks=128, hash_algorithm=algorithm, hash_seed_digest=digest)
    pub = RedisEventPublisher(redis_url, layout or RedisLayout(), replica_id, info, f"127.0.0.1:{free_port()}",
                              heartbeat_interval=0.2)
    pub.start()
    try:
        load = EngineLoad(free_blocks=119, running=0, waiting=0, usage=0.07, queued_prefill_tokens=0)
        hashes = tuple(hasher.event_ints(ids))
        pub.on_step([BlockStored(hashes, None, (), block_size)], load, lambda: {GPU: list(hashes)})
        yield pub
    finally:
        pub.close()


if __name__ == "__main__":
    _consumer_child(*sys.argv[1:4])
