"""EventConsumer against a real redis-server and real RedisEventPublishers (router/consumer.py, DESIGN.md §4, §5).

Each replica here is a RedisEventPublisher driven directly (no engine): random BlockStored /
BlockRemoved events, and a ReplicaCacheState fed the same events as the truth. After every fault
the index must equal, per replica and per medium, the truth's multiset of hashes within 2 s; the
wait calls each replica's idle step hook, as an idle engine does every 50 ms, so that snapshot
requests get answered.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
from collections import Counter
from collections.abc import Callable, Iterator

import pytest
import redis

from kvroute.engine_info import EngineInfo
from kvroute.events import CPU, GPU, MEDIA, BlockRemoved, BlockStored
from kvroute.hashing import BlockHasher
from kvroute.heartbeat import EngineLoad
from kvroute.ordering import ReplicaCacheState
from kvroute.redis_layout import F_REPLICA_ID, F_SEQ, RedisLayout
from kvroute.snapshot import decode_snapshot
from kvroute_tools.redis_server import RedisServer
from replica.publisher import RedisEventPublisher
from router.consumer import EventConsumer
from router.index import BlockIndex
from router.registry import ReplicaRegistry
from tests.support import wait_for

ROUTER_IDENTITY = BlockHasher().identity  # ("sha256_cbor", seed digest, 16)
LOAD = EngineLoad(free_blocks=40, running=2, waiting=1, usage=0.375, queued_prefill_tokens=96)


def engine_info(identity: tuple[str, str, int], num_blocks: int = 64) -> EngineInfo:
    """A replica's identity with the hash triple ``identity`` (algorithm, seed digest, block_size)."""
    algorithm, seed_digest, block_size = identity
    return EngineInfo(model="tiny", vocab_size=500, max_model_len=1024, block_size=block_size,
                      num_blocks=num_blocks, hash_algorithm=algorithm, hash_seed_digest=seed_digest)
SYNC_TIMEOUT = 2.0


# -- helpers ------------------------------------------------------------------------------------------
class FakeReplica:
    """A replica without an engine: a real publisher fed random events; ``truth`` is its cached set."""

    def __init__(self, server: RedisServer, layout: RedisLayout, replica_id: str, *, port: int = 50051,
                 seed: int = 0, identity: dict | None = None, **publisher_kw):
        self.replica_id = replica_id
        self.rng = random.Random(seed)
        self.truth = ReplicaCacheState()
        info = dataclasses.replace(engine_info(ROUTER_IDENTITY), **(identity or {}))
        publisher_kw.setdefault("heartbeat_interval", 0.2)
        publisher_kw.setdefault("snapshot_interval", 3600)  # snapshots only at start and on request
        self.pub = RedisEventPublisher(server.url, layout, replica_id, info, f"127.0.0.1:{port}", **publisher_kw)
        self.pub.start()

    def random_events(self) -> list:
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
        self.pub.on_step(events, LOAD, self.snapshot)

    def steps(self, n: int) -> None:
        for _ in range(n):
            self.step()

    def idle(self) -> None:
        """An idle engine tick: no events, but a wanted snapshot is taken."""
        self.pub.on_step([], LOAD, self.snapshot)

    def snapshot(self) -> dict[str, list[int]]:
        return {m: list(c.elements()) for m, c in self.truth.as_multiset().items()}

    def cached(self) -> dict[str, dict[int, int]]:
        return {m: dict(c) for m, c in self.truth.as_multiset().items()}

    def wait_written(self) -> None:
        wait_for(lambda: self.idle() or self.pub.last_seq_written == self.pub.last_seq, what="batches written")

    def close(self) -> None:
        self.pub.close()


def indexed(consumer: EventConsumer, replica_id: str) -> dict[str, dict[int, int]]:
    with consumer.index_lock:
        return {m: consumer.index.cached_set(replica_id, m) for m in MEDIA}


def in_sync(consumer: EventConsumer, replicas: list[FakeReplica]) -> bool:
    """The index holds exactly the replicas' cached multisets, per medium, and nobody else; the
    registry has their heartbeats."""
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


def wait_synced(consumer: EventConsumer, replicas: list[FakeReplica], timeout: float = SYNC_TIMEOUT,
                what: str = "the index to match the replicas") -> None:
    wait_for(lambda: in_sync(consumer, replicas), timeout, what)


def entries_of(r: redis.Redis, layout: RedisLayout, replica_id: str) -> list[tuple[bytes, dict]]:
    """(entry id, fields) of ``replica_id``'s stream entries, in stream order."""
    return [(eid, f) for eid, f in r.xrange(layout.events_stream(replica_id))
            if f[F_REPLICA_ID].decode() == replica_id]


def snapshot_seq(r: redis.Redis, layout: RedisLayout, replica_id: str) -> int:
    data = r.get(layout.snapshot_key(replica_id))
    assert data is not None, "no snapshot in Redis"
    return decode_snapshot(data).seq


@pytest.fixture
def server():
    with RedisServer() as s:
        yield s


@pytest.fixture
def layout():
    return RedisLayout(namespace="consumertest")


@pytest.fixture
def r(server):
    client = redis.Redis.from_url(server.url)
    yield client
    client.close()


@pytest.fixture
def replicas(server, layout) -> Iterator[Callable[..., FakeReplica]]:
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
def running_consumer(server: RedisServer, layout: RedisLayout, registry: ReplicaRegistry | None = None,
                     **kw) -> Iterator[EventConsumer]:
    registry = registry or ReplicaRegistry(ROUTER_IDENTITY, "redis")
    kw.setdefault("heartbeat_poll_interval", 0.1)
    kw.setdefault("block_ms", 50)
    consumer = EventConsumer(server.url, layout, BlockIndex(speculative_ttl=0), registry, **kw)
    consumer.start()
    try:
        assert consumer.wait_ready(5), "the consumer did not bootstrap"
        yield consumer
    finally:
        consumer.stop()


# -- following the streams -----------------------------------------------------------------------------
def test_follows_live_events_of_several_replicas_over_sharded_streams(server):
    layout = RedisLayout(namespace="consumertest", num_shards=2)
    made = []
    try:
        with running_consumer(server, layout) as consumer:
            made = [FakeReplica(server, layout, f"replica-{i}", port=50051 + i, seed=i) for i in range(3)]
            for _ in range(20):
                for rep in made:
                    rep.step()
            wait_synced(consumer, made)
            wait_for(lambda: consumer.registry.get("replica-1").free_blocks == 40, what="a heartbeat with load")
            info = consumer.registry.get("replica-1")
            assert info.routable and info.address == "127.0.0.1:50052" and info.epoch == made[1].pub.epoch
            assert (info.running, info.waiting, info.usage, info.queued_prefill_tokens) == (2, 1, 0.375, 96)
            assert consumer.batches_applied >= 60 and consumer.events_applied >= consumer.batches_applied
            assert consumer.gaps == consumer.resyncs == consumer.stale_batches == 0
            assert consumer.stream_lag_seconds < 5
    finally:
        for rep in made:
            rep.close()


def test_bootstrap_loads_the_snapshot_and_applies_only_the_entries_after_it(server, layout, r, replicas):
    a, b = replicas("replica-a"), replicas("replica-b")
    wait_for(lambda: a.pub.connected and b.pub.connected, what="publishers connected")
    a.steps(10)
    a.pub.request_snapshot()
    a.steps(10)
    b.steps(5)
    a.wait_written()
    b.wait_written()
    # Without the snapshot the stream alone no longer describes replica-a: its start is gone.
    cut = snapshot_seq(r, layout, "replica-a")
    assert cut > 10
    r.xdel(layout.events_stream("replica-a"),
           *[eid for eid, f in entries_of(r, layout, "replica-a") if int(f[F_SEQ]) <= cut])
    with running_consumer(server, layout) as consumer:
        wait_synced(consumer, [a, b])
        assert consumer.gaps == consumer.resyncs == consumer.snapshot_requests == 0
        a.steps(5)
        wait_synced(consumer, [a, b])


# -- event faults -----------------------------------------------------------------------------------------
def test_dropped_entries_open_a_gap_that_a_requested_snapshot_closes(server, layout, r, replicas):
    a, b = replicas("replica-a"), replicas("replica-b")
    a.steps(5)
    b.steps(5)
    a.wait_written()
    old_snapshot = snapshot_seq(r, layout, "replica-a")
    a.steps(10)
    a.wait_written()
    lost = [eid for eid, f in entries_of(r, layout, "replica-a") if old_snapshot + 3 <= int(f[F_SEQ]) <= old_snapshot + 5]
    assert r.xdel(layout.events_stream("replica-a"), *lost) == 3
    with running_consumer(server, layout) as consumer:
        a.steps(3)  # more entries while the gap is open: held, then applied after the snapshot
        wait_synced(consumer, [a, b])
        assert consumer.gaps >= 1 and consumer.resyncs >= 1 and consumer.snapshot_requests >= 1
        assert snapshot_seq(r, layout, "replica-a") > old_snapshot + 5, "a snapshot was requested"
        a.steps(3)
        wait_synced(consumer, [a, b])


def test_duplicated_entries_are_ignored(server, layout, r, replicas):
    a = replicas("replica-a")
    with running_consumer(server, layout) as consumer:
        a.steps(10)
        wait_synced(consumer, [a])
        entries = entries_of(r, layout, "replica-a")
        stream = layout.events_stream("replica-a")
        # The epoch's AllBlocksCleared, a BlockStored from the middle, and the last entry again.
        for _eid, fields in (entries[0], entries[4], entries[-1]):
            r.xadd(stream, fields)
        wait_for(lambda: consumer.stale_batches == 3, what="three stale batches")
        wait_synced(consumer, [a])
        a.steps(3)
        wait_synced(consumer, [a])
        assert consumer.gaps == consumer.resyncs == 0


def test_reordered_entries_are_applied_in_seq_order_without_a_snapshot(server, layout, r, replicas):
    a = replicas("replica-a")
    a.steps(3)
    a.wait_written()
    start = snapshot_seq(r, layout, "replica-a")
    a.steps(10)
    a.wait_written()
    # Rewrite the stream with two entries after the snapshot swapped (the publisher is idle).
    stream = layout.events_stream("replica-a")
    entries = [f for _eid, f in r.xrange(stream)]
    i = next(k for k, f in enumerate(entries) if int(f[F_SEQ]) == start + 3)
    entries[i], entries[i + 1] = entries[i + 1], entries[i]
    r.delete(stream)
    for fields in entries:
        r.xadd(stream, fields)
    with running_consumer(server, layout) as consumer:
        wait_synced(consumer, [a])
        assert consumer.resyncs == consumer.snapshot_requests == consumer.gaps == 0


def test_a_block_with_two_copies_stays_indexed_until_the_last_copy_is_removed(server, layout, replicas):
    a = replicas("replica-a")
    h = 0xDEADBEEF12345678
    with running_consumer(server, layout) as consumer:
        a.step([BlockStored((h,), None, (), 16)])
        a.step([BlockStored((h,), None, (), 16)])
        wait_synced(consumer, [a])
        assert indexed(consumer, "replica-a")[GPU] == {h: 2}
        a.step([BlockRemoved((h,), GPU)])
        wait_synced(consumer, [a])
        assert consumer.index.lookup([h])["replica-a"].gpu == 1, "one copy is still cached"
        a.step([BlockRemoved((h,), GPU)])
        wait_synced(consumer, [a])
        assert consumer.index.lookup([h])["replica-a"].gpu == 0


# -- restarts and expiry ---------------------------------------------------------------------------------
def test_a_restarted_router_rebuilds_the_same_index_mid_stream(server, layout, replicas):
    a, b = replicas("replica-a"), replicas("replica-b")
    with running_consumer(server, layout) as first:
        for _ in range(10):
            a.step()
            b.step()
        wait_synced(first, [a, b])
    for _ in range(10):  # while no router runs
        a.step()
        b.step()
    with running_consumer(server, layout) as second:
        for _ in range(5):
            a.step()
            b.step()
        wait_synced(second, [a, b])
        assert second.gaps == second.resyncs == 0


def test_a_restarted_replica_new_epoch_drops_what_was_known_of_it(server, layout, r, replicas):
    a = replicas("replica-a")
    with running_consumer(server, layout) as consumer:
        a.steps(10)
        wait_synced(consumer, [a])
        old_entry = entries_of(r, layout, "replica-a")[-1][1]
        a.close()
        restarted = replicas("replica-a", seed=99)  # a new publisher: a new epoch, an empty cache
        assert restarted.pub.epoch > a.pub.epoch
        restarted.steps(5)
        wait_synced(consumer, [restarted])
        assert consumer.epoch_changes >= 1
        assert consumer.registry.get("replica-a").epoch == restarted.pub.epoch
        r.xadd(layout.events_stream("replica-a"), old_entry)  # a late entry of the old epoch
        wait_for(lambda: consumer.stale_batches == 1, what="the old epoch's entry ignored")
        wait_synced(consumer, [restarted])


def test_heartbeat_expiry_drops_the_replica_and_its_entries(server, layout, replicas):
    a, b = replicas("replica-a"), replicas("replica-b")
    with running_consumer(server, layout) as consumer:
        a.steps(5)
        b.steps(5)
        wait_synced(consumer, [a, b])
        a.close()  # the heartbeat key expires after 3 x 0.2 s
        wait_for(
            lambda: consumer.registry.get("replica-a") is None and "replica-a" not in consumer.index.replicas,
            timeout=SYNC_TIMEOUT, what="replica-a expired and dropped",
        )
        assert [i.replica_id for i in consumer.registry.routable()] == ["replica-b"]
        wait_synced(consumer, [b])


def test_redis_restart_reconnects_and_resyncs(server, layout, replicas):
    a = replicas("replica-a", buffer_size=3)  # a long outage drops batches: a real seq gap
    b = replicas("replica-b")
    with running_consumer(server, layout) as consumer:
        a.steps(5)
        b.steps(5)
        wait_synced(consumer, [a, b])
        server.stop()
        wait_for(lambda: not consumer.connected, what="the consumer to notice")
        a.steps(6)
        b.steps(2)
        assert a.pub.batches_dropped > 0
        server.start()  # same port, empty: streams, heartbeats and snapshots are gone
        wait_synced(consumer, [a, b], timeout=SYNC_TIMEOUT + 1.0)  # + the reconnect backoff (<= 1 s)
        assert consumer.reconnects >= 1 and consumer.resyncs >= 1
        assert {i.replica_id for i in consumer.registry.routable()} == {"replica-a", "replica-b"}
        a.steps(3)
        wait_synced(consumer, [a, b])


# -- a real KV cache manager -----------------------------------------------------------------------------------
def test_the_index_tracks_a_real_kv_cache_manager_through_a_router_restart(server, layout):
    """Realistic events: shared prefixes, duplicate copies, evictions offloaded to the CPU tier."""
    from replica.kv import KVCacheManager, SimpleKVRequest

    mgr = KVCacheManager(num_blocks=24, block_size=4, cpu_num_blocks=8, copy_fn=lambda *a: None)
    info = engine_info(mgr.hasher.identity, num_blocks=24)
    pub = RedisEventPublisher(server.url, layout, "replica-kv", info, "127.0.0.1:50051", heartbeat_interval=0.2)
    pub.start()
    rng = random.Random(7)
    prefixes = [[rng.randrange(1, 500) for _ in range(16)] for _ in range(3)]
    running: list = []

    def step(i: int) -> None:
        if len(running) >= 3 or (running and rng.random() < 0.4):
            mgr.free(running.pop(rng.randrange(len(running))))
        prompt = rng.choice(prefixes)[: rng.choice((8, 12, 16))] + [rng.randrange(1, 500) for _ in range(5)]
        req = SimpleKVRequest(f"r{i}", prompt)
        computed = mgr.get_computed_blocks(req)
        n = computed.num_computed_tokens
        if mgr.allocate_slots(req, req.num_tokens - n, n, computed) is not None:
            req.num_computed_tokens = req.num_tokens
            running.append(req)
        pub.on_step(mgr.take_events(), LOAD, mgr.cached_event_hashes)

    def synced(consumer: EventConsumer) -> bool:
        pub.on_step([], LOAD, mgr.cached_event_hashes)
        info = consumer.registry.get("replica-kv")
        if info is None or not info.routable:
            return False
        want = {m: dict(Counter(h)) for m, h in mgr.cached_event_hashes().items()}
        got = indexed(consumer, "replica-kv")
        return all(got[m] == want.get(m, {}) for m in MEDIA)

    try:
        with running_consumer(server, layout, ReplicaRegistry(mgr.hasher.identity)) as first:
            for i in range(60):
                step(i)
            wait_for(lambda: synced(first), SYNC_TIMEOUT, "the index to match the manager")
        for i in range(60, 90):
            step(i)
        with running_consumer(server, layout, ReplicaRegistry(mgr.hasher.identity)) as second:
            for i in range(90, 150):
                step(i)
            wait_for(lambda: synced(second), SYNC_TIMEOUT, "the restarted router's index")
            assert second.index.num_entries("replica-kv", CPU) > 0, "the workload offloads to the CPU tier"
    finally:
        pub.close()


# -- registry and discovery ---------------------------------------------------------------------------------
def test_incompatible_replicas_are_not_routable_and_not_indexed(server, layout, replicas):
    ok = replicas("replica-ok")
    big = replicas("replica-big", identity={"block_size": 32})
    salted = replicas("replica-salted", identity={"hash_seed_digest": BlockHasher(seed="other").seed_digest})
    registry = ReplicaRegistry(ROUTER_IDENTITY, "redis")
    with running_consumer(server, layout, registry) as consumer:
        for rep in (ok, big, salted):
            rep.steps(5)
        wait_synced(consumer, [ok])
        wait_for(lambda: len(registry.all()) == 3, what="three heartbeats")
        assert [i.replica_id for i in registry.routable()] == ["replica-ok"]
        assert registry.get("replica-big").reason == "block_size 32 != router's 16"
        assert registry.get("replica-salted").reason.startswith("hash_seed_digest ")
        assert registry.num_incompatible == 2
        assert set(consumer.entries()) <= {"replica-ok"}


def test_static_discovery_gates_the_index_and_a_rediscovered_replica_resyncs(server, layout, replicas):
    a, b = replicas("replica-a", port=50051), replicas("replica-b", port=50052)
    registry = ReplicaRegistry(ROUTER_IDENTITY, "static")
    registry.set_discovered({"127.0.0.1:50051"})
    with running_consumer(server, layout, registry) as consumer:
        a.steps(5)
        b.steps(5)
        wait_synced(consumer, [a])  # replica-b heartbeats but is not discovered: not indexed
        assert registry.get("replica-b").reason == "address 127.0.0.1:50052 not discovered (static discovery)"
        registry.set_discovered({"127.0.0.1:50051", "127.0.0.1:50052"})  # from another thread
        wait_synced(consumer, [a, b])  # b is idle: the stalled-heartbeat check resyncs it
        registry.set_discovered({"127.0.0.1:50052"})
        wait_synced(consumer, [b])
        b.steps(3)
        wait_synced(consumer, [b])
