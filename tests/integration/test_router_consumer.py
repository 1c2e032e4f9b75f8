"""EventConsumer following the event streams through faults, against a real redis-server and real
RedisEventPublishers (router/consumer.py, router/consumer_feed.py, DESIGN.md §4, §5).

Each replica here is a tests.support_redis.FakeReplica: a RedisEventPublisher driven directly (no
engine) with random BlockStored / BlockRemoved events, and a ReplicaCacheState fed the same events
as the truth. After every fault the index must equal, per replica and per medium, the truth's
multiset of hashes within 2 s; the wait calls each replica's idle step hook, as an idle engine does
every 50 ms, so that snapshot requests get answered. Restarts, expiry and discovery:
test_router_consumer_lifecycle.py.
"""

from __future__ import annotations

import random
from collections import Counter

from kvroute.events import CPU, GPU, MEDIA, BlockRemoved, BlockStored
from kvroute.heartbeat import EngineLoad
from kvroute.redis_layout import F_SEQ, RedisLayout
from replica.publisher import RedisEventPublisher
from router.consumer import EventConsumer
from router.registry import ReplicaRegistry
from tests import support_redis
from tests.support import wait_for
from tests.support_redis import (
    FAKE_LOAD_FIELDS,
    SYNC_TIMEOUT,
    FakeReplica,
    engine_info,
    indexed,
    read_snapshot,
    replica_entries,
    running_consumer,
    wait_synced,
)

LOAD = EngineLoad(**FAKE_LOAD_FIELDS)  # what FakeReplica reports

# The shared fixtures (tests.support), under the names the tests take.
server = support_redis.redis_server
layout = support_redis.redis_layout
r = support_redis.redis_client
fake_replicas = support_redis.fake_replicas


# -- following the streams -----------------------------------------------------------------------------------
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


def test_bootstrap_loads_the_snapshot_and_applies_only_the_entries_after_it(server, layout, r, fake_replicas):
    a, b = fake_replicas("replica-a"), fake_replicas("replica-b")
    wait_for(lambda: a.pub.connected and b.pub.connected, what="publishers connected")
    a.steps(10)
    a.pub.request_snapshot()
    a.steps(10)
    b.steps(5)
    a.wait_written()
    b.wait_written()
    # Without the snapshot the stream alone no longer describes replica-a: its start is gone.
    cut = read_snapshot(r, layout, "replica-a").seq
    assert cut > 10
    r.xdel(layout.events_stream("replica-a"),
           *[eid for eid, f in replica_entries(r, layout, "replica-a") if int(f[F_SEQ]) <= cut])
    with running_consumer(server, layout) as consumer:
        wait_synced(consumer, [a, b])
        assert consumer.gaps == consumer.resyncs == consumer.snapshot_requests == 0
        a.steps(5)
        wait_synced(consumer, [a, b])


# -- event faults --------------------------------------------------------------------------------------------
def test_dropped_entries_open_a_gap_that_a_requested_snapshot_closes(server, layout, r, fake_replicas):
    a, b = fake_replicas("replica-a"), fake_replicas("replica-b")
    a.steps(5)
    b.steps(5)
    a.wait_written()
    old_snapshot = read_snapshot(r, layout, "replica-a").seq
    a.steps(10)
    a.wait_written()
    lost = [eid for eid, f in replica_entries(r, layout, "replica-a") if old_snapshot + 3 <= int(f[F_SEQ]) <= old_snapshot + 5]
    assert r.xdel(layout.events_stream("replica-a"), *lost) == 3
    with running_consumer(server, layout) as consumer:
        a.steps(3)  # more entries while the gap is open: held, then applied after the snapshot
        wait_synced(consumer, [a, b])
        assert consumer.gaps >= 1 and consumer.resyncs >= 1 and consumer.snapshot_requests >= 1
        assert read_snapshot(r, layout, "replica-a").seq > old_snapshot + 5, "a snapshot was requested"
        a.steps(3)
        wait_synced(consumer, [a, b])


def test_duplicated_entries_are_ignored(server, layout, r, fake_replicas):
    a = fake_replicas("replica-a")
    with running_consumer(server, layout) as consumer:
        a.steps(10)
        wait_synced(consumer, [a])
        entries = replica_entries(r, layout, "replica-a")
        stream = layout.events_stream("replica-a")
        # The epoch's AllBlocksCleared, a BlockStored from the middle, and the last entry again.
        for _eid, fields in (entries[0], entries[4], entries[-1]):
            r.xadd(stream, fields)
        wait_for(lambda: consumer.stale_batches == 3, what="three stale batches")
        wait_synced(consumer, [a])
        a.steps(3)
        wait_synced(consumer, [a])
        assert consumer.gaps == consumer.resyncs == 0


def test_reordered_entries_are_applied_in_seq_order_without_a_snapshot(server, layout, r, fake_replicas):
    a = fake_replicas("replica-a")
    a.steps(3)
    a.wait_written()
    start = read_snapshot(r, layout, "replica-a").seq
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


def test_a_block_with_two_copies_stays_indexed_until_the_last_copy_is_removed(server, layout, fake_replicas):
    a = fake_replicas("replica-a")
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


# -- a real KV cache manager ---------------------------------------------------------------------------------
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


