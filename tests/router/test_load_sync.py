"""What routers share (router/load_sync.py, router.core.Router.share / merge): the wire format of a
router's hash, one router's in-flight load and speculative entries in another's decisions, and two
RedisLoadSync threads' syncs through a real redis-server."""

from __future__ import annotations

from kvroute.hashing import BlockHasher
from kvroute.heartbeat import EngineLoad, Heartbeat
from kvroute.redis_layout import RedisLayout
from router.core import Router
from router.index import BlockIndex
from router.load import LoadTracker, RouterShare
from router.load_sync import RedisLoadSync, decode_share, encode_share
from router.policies.kvroute import KVRoutePolicy
from router.registry import ReplicaRegistry
from tests.support import wait_for
from tests.support_redis import redis_server as server  # noqa: F401 - the fixture, as its tests name it

B = 16


def new_router(replicas=("X", "Y")) -> Router:
    hasher = BlockHasher()
    registry = ReplicaRegistry(hasher.identity, "redis")
    algorithm, digest, block_size = hasher.identity
    for rid in replicas:
        hb = Heartbeat(replica_id=rid, address=f"{rid}:1", epoch=1, last_seq=0, model="m", block_size=block_size,
                       hash_algorithm=algorithm, hash_seed_digest=digest, num_blocks=128,
                       load=EngineLoad(free_blocks=127, running=0, waiting=0, usage=0.0, queued_prefill_tokens=0),
                       ts=0.0)
        registry.update_from_heartbeat(hb, 0.0)
    return Router(hasher, BlockIndex(speculative_ttl=2.0), registry, LoadTracker(), KVRoutePolicy())


def test_a_share_survives_the_wire_and_a_bad_field_hides_only_itself():
    share = RouterShare({"X": (3, 480), "Y": (0, 0)}, {"X": [1, 2**64 - 1], "Z": [7]})
    fields = encode_share(share)
    assert fields["Y"] == b"0,0"  # what a router without speculative entries there always wrote
    assert fields["X"] == b"3,480," + (1).to_bytes(8, "big") + (2**64 - 1).to_bytes(8, "big")
    raw = {k.encode(): v for k, v in fields.items()} | {b"bad": b"x,1", b"\xff": b"1,1"}
    got, bad = decode_share(raw)
    assert bad == 2
    assert got.load == {"X": (3, 480), "Y": (0, 0), "Z": (0, 0)}
    assert {r: list(h) for r, h in got.speculative.items()} == {"X": [1, 2**64 - 1], "Z": [7]}


def test_another_routers_load_and_held_prefix_steer_this_routers_pick():
    a, b = new_router(), new_router()
    prompt = list(range(10, 10 + 4 * B + 1))
    first = a.decide(prompt)
    picked = first.picked.replica_id
    a.commit(first)  # held on a's pick until its prefill is done
    share = a.share()
    other = "Y" if picked == "X" else "X"
    assert share.load == {picked: (1, len(prompt))}
    assert {r: set(h) for r, h in share.speculative.items()} == {picked: set(a.hasher.event_ints(prompt))}
    b.merge("router-a", share)
    d = b.decide(prompt)
    assert d.picked.replica_id == picked  # its 4 blocks are there (speculatively) and nowhere else
    assert d.score_of(picked).candidate.in_flight == 1
    assert d.score_of(picked).candidate.match.speculative == 4
    assert d.score_of(other).candidate.match.gpu == 0
    b.merge("router-a", None)  # router a's key expired
    assert b.decide(prompt).score_of(picked).candidate.match.gpu == 0
    assert b.load.totals(picked) == (0, 0)


def test_entries_for_a_replica_this_router_does_not_route_to_are_left_out():
    b = new_router(replicas=("X",))
    b.merge("router-a", RouterShare({"gone": (1, 16)}, {"gone": [1, 2], "X": [3]}))
    assert b.index.replicas == ["X"]  # "gone" gets no place in the index
    assert b.load.totals("gone") == (1, 16)  # load of an unknown replica is harmless: nobody scores it


def test_two_routers_see_each_others_share_through_redis(server):  # noqa: F811
    layout = RedisLayout(namespace="test")
    interval = 0.05
    a, b = new_router(), new_router()
    sync_a = RedisLoadSync(server.url, layout, "a", a, interval=interval)
    sync_b = RedisLoadSync(server.url, layout, "b", b, interval=interval)
    prompt = list(range(10, 10 + 2 * B + 1))
    ticket = a.commit(a.decide(prompt))
    sync_a.start()
    sync_b.start()
    try:
        rid = ticket.replica_id
        wait_for(lambda: b.load.totals(rid) == (1, len(prompt)), timeout=5, what="a's load in b")
        wait_for(lambda: b.decide(prompt).score_of(rid).candidate.match.speculative == 2, timeout=5,
                 what="a's held prefix in b")
        a.finish(ticket)
        wait_for(lambda: b.load.totals(rid) == (0, 0), timeout=5, what="a's finish in b")
    finally:
        sync_a.stop()
        wait_for(lambda: b.load.remote_routers() == [], timeout=5, what="a gone from b (its key deleted)")
        sync_b.stop()
