"""kvroute on a real Redis Cluster: 3 masters and 3 replicas on loopback
(kvroute_tools.redis_server.RedisClusterServer), real RedisEventPublishers (tests.support_redis
FakeReplica) over event shards spread across the masters, a real router consumer (DESIGN.md §4:
one hash slot per shard; a failover is a seq gap resynced from the snapshot), and two routers'
load sync."""

from __future__ import annotations

import signal

import pytest
from redis.crc import key_slot

from kvroute.redis_connect import connect
from kvroute.redis_layout import F_SEQ, RedisLayout
from kvroute_tools.redis_server import RedisClusterServer
from tests.support import wait_for
from tests.support_redis import (
    ConsumerProcess,
    FakeReplica,
    read_snapshot,
    replica_entries,
    running_consumer,
    wait_synced,
)

SHARDS = 4


@pytest.fixture
def cluster():
    with RedisClusterServer(masters=3, replicas_per_master=1) as c:
        yield c


@pytest.fixture
def replicas(cluster, request):
    """One FakeReplica per event shard of namespace ``request.node.name`` (ids picked so that
    every shard has one), on the cluster; closed at the end."""
    layout = RedisLayout(request.node.name[:40], SHARDS)
    ids: dict[int, str] = {}
    i = 0
    while len(ids) < SHARDS:
        ids.setdefault(layout.shard(f"replica-{i}"), f"replica-{i}")
        i += 1
    made = [FakeReplica(cluster, layout, rid, port=50051 + k, seed=k) for k, rid in sorted(ids.items())]
    yield layout, made
    for rep in made:
        rep.close()


def _master_of_shard(cluster, layout, rep):
    return cluster.master_of(key_slot(layout.events_stream(rep.replica_id).encode()))


def test_events_snapshots_and_heartbeats_flow_over_shards_on_several_masters(cluster, replicas):
    layout, made = replicas
    assert len({_master_of_shard(cluster, layout, rep).port for rep in made}) >= 2
    r = connect(cluster.url)
    a = made[0]
    for rep in made:
        rep.steps(10)
        rep.wait_written()
    # Entries of replica a lost from its stream: the consumer sees a gap, PUBLISHes a snapshot
    # request, and a's publisher, subscribed on its shard's node, answers it.
    old_snapshot = read_snapshot(r, layout, a.replica_id).seq
    lost = [eid for eid, f in replica_entries(r, layout, a.replica_id) if int(f[F_SEQ]) in (4, 5)]
    assert r.xdel(layout.events_stream(a.replica_id), *lost) == 2
    with running_consumer(cluster, layout) as consumer:
        for _ in range(10):
            for rep in made:
                rep.step()
        wait_synced(consumer, made, timeout=5)
        assert consumer.gaps >= 1 and consumer.resyncs >= 1 and consumer.snapshot_requests >= 1
        assert read_snapshot(r, layout, a.replica_id).seq > old_snapshot, "a snapshot was requested"
        assert consumer.reconnects == 0 and consumer.rejected["heartbeat"] == 0
        wait_for(lambda: consumer.registry.get(made[1].replica_id).free_blocks == 40, what="a heartbeat with load")
        assert consumer.registry.get(made[1].replica_id).routable
    with running_consumer(cluster, layout) as late:  # a bootstrap from the snapshots and streams
        wait_synced(late, made, timeout=5)
    r.close()


def test_a_master_killed_during_traffic_fails_over_and_the_router_resyncs_what_it_lost(cluster, replicas):
    layout, made = replicas
    for rep in made:
        rep.steps(5)
    victim = made[0]
    master = _master_of_shard(cluster, layout, victim)
    with ConsumerProcess(cluster.url, layout) as router:
        wait_synced(router, made, timeout=5)
        before = router.view()["stats"]
        # The victim's batches from now on reach only its master: its replica stops replicating,
        # and the router stops reading, so the failover loses batches nobody read.
        replica = cluster.freeze_replica_of(master)
        router.pause()
        # An XREAD the router has out would still take the batches into its socket: let it time out.
        wait_for(lambda: cluster.blocked_clients(master) == 0, what="the router's XREAD to time out")
        for rep in made:
            rep.steps(5)
        victim.wait_written()  # acknowledged by the master
        master.stop()  # SIGKILL
        replica.signal(signal.SIGCONT)  # stale, but cluster-replica-validity-factor 0 lets it take over
        slot = key_slot(layout.events_stream(victim.replica_id).encode())
        wait_for(lambda: cluster.master_of(slot).port == replica.port, timeout=15, what="the replica promoted",
                 interval=0.1)
        for rep in made:
            rep.steps(3)  # seqs past the lost ones, on the new master
        router.resume()
        wait_synced(router, made, timeout=10)
        stats = router.view()["stats"]
        assert stats["gaps"] > before["gaps"] and stats["resyncs"] > before["resyncs"]
        assert stats["reconnects"] >= 1 and stats["connected"]
        for rep in made:  # and it follows on
            rep.steps(3)
        wait_synced(router, made, timeout=5)


def test_two_routers_share_their_load_over_the_cluster(cluster):
    from router.load_sync import RedisLoadSync
    from tests.router.test_load_sync import new_router

    layout = RedisLayout("loadsync", SHARDS)
    a, b = new_router(), new_router()
    syncs = [RedisLoadSync(cluster.url, layout, name, router, interval=0.05) for name, router in (("a", a), ("b", b))]
    ticket = a.commit(a.decide(list(range(40))))
    for sync in syncs:
        sync.start()
    try:
        wait_for(lambda: b.load.totals(ticket.replica_id) == (1, 40), timeout=5, what="a's load in b")
        a.finish(ticket)
        wait_for(lambda: b.load.totals(ticket.replica_id) == (0, 0), timeout=5, what="a's finish in b")
    finally:
        syncs[0].stop()
        wait_for(lambda: b.load.remote_routers() == [], timeout=5, what="a gone from b (its key deleted)")
        syncs[1].stop()
