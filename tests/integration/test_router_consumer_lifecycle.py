"""EventConsumer through restarts (router, replica, Redis), heartbeat expiry, incompatible replicas
and discovery, against a real redis-server and real RedisEventPublishers (router/consumer.py,
router/consumer_feed.py, DESIGN.md §4, §5). The replicas and the sync check are those of
test_router_consumer.py (tests.support_redis.FakeReplica, wait_synced).
"""

from __future__ import annotations

from kvroute.hashing import BlockHasher
from kvroute.redis_layout import F_SEQ
from router.registry import ReplicaRegistry
from tests import support_redis
from tests.support import wait_for
from tests.support_redis import SYNC_TIMEOUT, replica_entries, running_consumer, wait_synced

ROUTER_IDENTITY = BlockHasher().identity  # ("sha256_cbor", seed digest, 16)

# The shared fixtures (tests.support), under the names the tests take.
server = support_redis.redis_server
layout = support_redis.redis_layout
r = support_redis.redis_client
fake_replicas = support_redis.fake_replicas


# -- restarts and expiry -------------------------------------------------------------------------------------
def test_a_restarted_router_rebuilds_the_same_index_mid_stream(server, layout, fake_replicas):
    a, b = fake_replicas("replica-a"), fake_replicas("replica-b")
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


def test_a_restarted_replica_new_epoch_drops_what_was_known_of_it(server, layout, r, fake_replicas):
    a = fake_replicas("replica-a")
    with running_consumer(server, layout) as consumer:
        a.steps(10)
        wait_synced(consumer, [a])
        old_entry = replica_entries(r, layout, "replica-a")[-1][1]
        a.close()
        restarted = fake_replicas("replica-a", seed=99)  # a new publisher: a new epoch, an empty cache
        assert restarted.pub.epoch > a.pub.epoch
        restarted.steps(5)
        wait_synced(consumer, [restarted])
        assert consumer.epoch_changes >= 1
        assert consumer.registry.get("replica-a").epoch == restarted.pub.epoch
        r.xadd(layout.events_stream("replica-a"), old_entry)  # a late entry of the old epoch
        wait_for(lambda: consumer.stale_batches == 1, what="the old epoch's entry ignored")
        wait_synced(consumer, [restarted])


def test_heartbeat_expiry_drops_the_replica_and_its_entries(server, layout, fake_replicas):
    a, b = fake_replicas("replica-a"), fake_replicas("replica-b")
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


def test_a_late_entry_of_an_expired_replica_is_not_indexed_nor_gap_counted(server, layout, r, fake_replicas):
    a, b = fake_replicas("replica-a"), fake_replicas("replica-b")
    with running_consumer(server, layout) as consumer:
        a.steps(5)
        b.steps(2)
        wait_synced(consumer, [a, b])
        late = dict(replica_entries(r, layout, "replica-a")[-1][1])
        a.close()  # its heartbeat key expires; its snapshot key (no TTL) stays
        wait_for(lambda: consumer.registry.get("replica-a") is None and "replica-a" not in consumer.index.replicas,
                 timeout=SYNC_TIMEOUT, what="replica-a expired and dropped")
        late[F_SEQ] = str(int(late[F_SEQ]) + 3).encode()  # a batch read after the expiry, past a hole
        r.xadd(layout.events_stream("replica-a"), late)
        wait_for(lambda: consumer.stale_batches + consumer.gaps >= 1, what="the late entry read")
        b.steps(1)
        wait_synced(consumer, [b])
        assert (consumer.gaps, consumer.resyncs, consumer.snapshot_requests) == (0, 0, 0)
        assert "replica-a" not in consumer.index.replicas


def test_two_replicas_heartbeating_under_one_id_are_flagged(server, layout, fake_replicas):
    with running_consumer(server, layout) as consumer:
        fake_replicas("replica-0", port=50051)
        # A second cluster's replica-0 on the same namespace. Another heartbeat interval, so that
        # the two writes drift past each other: with one interval and nearly one phase, every poll
        # could read the same one of them.
        fake_replicas("replica-0", port=50052, heartbeat_interval=0.33)
        wait_for(lambda: consumer.registry.address_changes >= 2, what="the address of replica-0 flipping")


def test_redis_restart_reconnects_and_resyncs(server, layout, fake_replicas):
    a = fake_replicas("replica-a", buffer_size=3)  # a long outage drops batches: a real seq gap
    b = fake_replicas("replica-b")
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


# -- registry and discovery ----------------------------------------------------------------------------------
def test_incompatible_replicas_are_not_routable_and_not_indexed(server, layout, fake_replicas):
    ok = fake_replicas("replica-ok")
    big = fake_replicas("replica-big", identity={"block_size": 32})
    salted = fake_replicas("replica-salted", identity={"hash_seed_digest": BlockHasher(seed="other").seed_digest})
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


def test_static_discovery_gates_the_index_and_a_rediscovered_replica_resyncs(server, layout, fake_replicas):
    a, b = fake_replicas("replica-a", port=50051), fake_replicas("replica-b", port=50052)
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


