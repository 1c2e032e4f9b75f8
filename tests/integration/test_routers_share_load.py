"""Two routers on one Redis route as one would (router/load_sync.py, DESIGN.md §5 "Several routers"):
router A's calls in flight and its speculative holds reach router B's decisions within the load
sync's delay, with the costs worked out by hand from the cost model (router/policies/kvroute.py).

One real redis-server, two replicas without an engine (tests.support_redis.FakeReplica: real
publishers, heartbeats every 0.2 s reporting an idle engine: nothing running, waiting or queued,
KV usage 0), two real routers (BackgroundRouter, seeded, load sync every 0.1 s). A's picks are made
with its routing service (``route``, forced onto rep-x by excluding rep-y) and held without a
generation (the replicas have no engine); B's decision is read with RouterService.Score.

The cost of a replica for a prompt of ``n`` tokens, with the rates fixed by the settings (1,000
prefill tokens/s) and idle replicas (no running, waiting or KV usage term)::

    cost = (queued + u) / 1000 + 30 * u / 1000       u = n - 16 * matched blocks (at least 1)

where ``queued`` is the larger of the heartbeat's queued prefill (0) and the prompt tokens the
routers have sent there and not seen prefilled (A's, once synced).
"""

from __future__ import annotations

import random

import grpc
import pytest

from kvroute.events import BlockStored
from kvroute.hashing import BlockHasher
from kvroute.heartbeat import EngineLoad
from kvroute.v1 import generation_pb2 as gen_pb
from kvroute.v1 import router_pb2 as router_pb
from kvroute.v1 import router_pb2_grpc as router_grpc
from router.server import BackgroundRouter
from router.settings import RouterSettings
from tests.support import wait_for
from tests.support_redis import FakeReplica

B = 16
SEED = 7
SYNC_S = 0.1
T = 10.0  # deadline of every call
IDLE = EngineLoad(free_blocks=63, running=0, waiting=0, usage=0.0, queued_prefill_tokens=0)


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 500) for _ in range(n)]


SHARED = prompt(1, 4 * B + 1)  # 65 tokens: 4 full blocks, cached on both replicas


@pytest.fixture(scope="module")
def layout():
    from kvroute.redis_layout import RedisLayout

    return RedisLayout(namespace="test")


@pytest.fixture(scope="module")
def replicas(redis_server, layout):
    hashes = tuple(BlockHasher().event_ints(SHARED))
    made = [FakeReplica(redis_server, layout, rid, port=50061 + k) for k, rid in enumerate(("rep-x", "rep-y"))]
    try:
        for rep in made:
            rep.load = IDLE
            rep.step([BlockStored(hashes, None, (), B)])
            rep.wait_written()
        yield made
    finally:
        for rep in made:
            rep.close()


def settings(redis_server, model_dir) -> RouterSettings:
    return RouterSettings(host="127.0.0.1", port=0, redis_url=redis_server.url, namespace="test",
                          model=str(model_dir), seed=SEED, heartbeat_poll_interval=0.1, load_sync_interval=SYNC_S,
                          prefill_tokens_per_s=1000.0, decode_seconds_per_running=0.01)


@pytest.fixture(scope="module")
def routers(redis_server, default_model_dir, replicas):
    s = settings(redis_server, default_model_dir)
    with BackgroundRouter(s) as a, BackgroundRouter(s) as b:
        for r in (a, b):
            wait_for(lambda r=r: {i.replica_id for i in r.server.registry.routable()} == {"rep-x", "rep-y"},
                     what="both replicas routable")
        yield a, b


@pytest.fixture(scope="module")
def score_b(routers):
    channel = grpc.insecure_channel(routers[1].target)
    stub = router_grpc.RouterServiceStub(channel)

    def score(ids) -> router_pb.ScoreResponse:
        return stub.Score(router_pb.ScoreRequest(token_ids=gen_pb.TokenIds(ids=ids)), timeout=T)

    yield score
    channel.close()


def by_id(resp: router_pb.ScoreResponse) -> dict[str, router_pb.ReplicaScore]:
    return {r.replica_id: r for r in resp.replicas}


def test_without_the_other_routers_load_an_exact_tie_goes_as_the_seed_says(routers, score_b):
    """The shared prompt on idle replicas: u = 65 - 64 = 1 on both, so both cost
    (0 + 1) / 1000 + 30 / 1000 = 0.031 s, an exact tie. B's policy breaks it with its generator
    seeded SEED: ``random.Random(SEED).choice`` over its candidates in its registry's order (this
    is B's first decision, so its first draw)."""
    a, b = routers
    resp = score_b(SHARED)
    scores = by_id(resp)
    assert scores["rep-x"].gpu_matched_blocks == scores["rep-y"].gpu_matched_blocks == 4
    assert scores["rep-x"].cost == scores["rep-y"].cost == pytest.approx(0.031)
    candidates = [i.replica_id for i in b.server.registry.routable()]
    assert resp.picked_replica_id == random.Random(SEED).choice(candidates)


def test_calls_in_flight_through_one_router_steer_the_other_to_the_idle_replica(routers, score_b):
    """A routes three fresh 33-token prompts to rep-x and holds them (no first token): 3 in flight
    and 3 x 33 = 99 prompt tokens queued there. Once B has synced, the shared prompt costs
    (99 + 1) / 1000 + 30 / 1000 = 0.130 s on rep-x against 0.031 s on rep-y: rep-y. When A's
    calls finish, B sees rep-x idle again: the tie of 0.031 s each."""
    a, _ = routers
    routing = a.server.routing
    held = [routing.route(prompt(100 + k, 2 * B + 1), exclude=("rep-y",)) for k in range(3)]
    try:
        assert {r.replica.replica_id for r in held} == {"rep-x"}
        wait_for(lambda: by_id(score_b(SHARED))["rep-x"].in_flight == 3, timeout=5, what="A's load in B")
        resp = score_b(SHARED)
        x, y = by_id(resp)["rep-x"], by_id(resp)["rep-y"]
        assert (x.in_flight, x.queued_prefill_tokens, y.in_flight, y.queued_prefill_tokens) == (3, 99, 0, 0)
        assert x.cost == pytest.approx(0.130)
        assert y.cost == pytest.approx(0.031)
        assert resp.picked_replica_id == "rep-y"
    finally:
        for r in held:
            routing.finish(r.ticket)
    wait_for(lambda: by_id(score_b(SHARED))["rep-x"].in_flight == 0, timeout=5, what="A's finish in B")
    scores = by_id(score_b(SHARED))
    assert scores["rep-x"].cost == scores["rep-y"].cost == pytest.approx(0.031)


def test_a_prefix_held_by_one_router_steers_the_other_to_it(routers, score_b):
    """A routes a fresh 65-token prompt to rep-x and holds it (waiting for its prefill, so no KV
    event yet): its 4 blocks are A's speculative entries on rep-x, and B gets them with A's load.
    B's cost for the same prompt: rep-x (65 + 1) / 1000 + 30 x 1 / 1000 = 0.096 s (4 blocks
    matched speculatively, 65 tokens queued), rep-y (0 + 65) / 1000 + 30 x 65 / 1000 = 2.015 s:
    rep-x. (Without A's holds B would see rep-x at (65 + 65) / 1000 + 1.95 = 2.080 s and pick
    rep-y, computing the prefix a second time.) A withdraws it (the replica refused the call):
    B's entries go at its next sync, and both cost 2.015 s."""
    a, _ = routers
    routing = a.server.routing
    fresh = prompt(2, 4 * B + 1)
    route = routing.route(fresh, exclude=("rep-y",))
    try:
        wait_for(lambda: by_id(score_b(fresh))["rep-x"].speculative_matched_blocks == 4, timeout=5,
                 what="A's hold in B")
        resp = score_b(fresh)
        x, y = by_id(resp)["rep-x"], by_id(resp)["rep-y"]
        assert (x.gpu_matched_blocks, x.queued_prefill_tokens, x.in_flight) == (4, 65, 1)
        assert x.cost == pytest.approx(0.096)
        assert (y.gpu_matched_blocks, y.cost) == (0, pytest.approx(2.015))
        assert resp.picked_replica_id == "rep-x"
    finally:
        routing.withdraw(route.decision)
        routing.finish(route.ticket)
    wait_for(lambda: by_id(score_b(fresh))["rep-x"].speculative_matched_blocks == 0, timeout=5,
             what="A's withdrawal in B")
    scores = by_id(score_b(fresh))
    assert scores["rep-x"].cost == scores["rep-y"].cost == pytest.approx(2.015)
