"""A replica whose serving process is frozen (SIGSTOP) leaves the router's view within its heartbeat
TTL, although its engine process (which writes the heartbeats) still runs: the serving process's
event loop says it is alive every half interval, and the publisher withholds heartbeats once it
has been silent longer than the TTL (replica/server.py, replica/publisher/redis_publisher.py).

``kvroute up`` with two replicas (heartbeat every 0.2 s, so their keys live 0.6 s) and a router
polling heartbeats every 0.1 s. A prompt is served once, so one replica holds its prefix and the
router sends every call with that prefix there. That replica's serving process is then stopped:
its heartbeat key must expire, and the same calls (each with a deadline) must be served by the
other replica. After SIGCONT its heartbeats resume and it is routable again.
"""

from __future__ import annotations

import os
import random
import signal

import grpc
import pytest
import redis

from kvroute.redis_layout import RedisLayout
from kvroute.v1 import generation_pb2 as gen_pb
from kvroute.v1 import generation_pb2_grpc as gen_grpc
from kvroute.v1 import router_pb2 as router_pb
from kvroute.v1 import router_pb2_grpc as router_grpc
from kvroute_tools.cluster import ClusterConfig, LocalCluster
from tests.support import wait_for

pytestmark = pytest.mark.slow

T = 20.0  # deadline of every call
HEARTBEAT = 0.2
TTL = 3 * HEARTBEAT
PREFIX = [random.Random(7).randrange(10, 500) for _ in range(256)]


def served_by(gen: gen_grpc.GenerationServiceStub, suffix_seed: int) -> str:
    """The replica that served one call whose prompt starts with PREFIX (the router's trailer)."""
    suffix = [random.Random(suffix_seed).randrange(10, 500) for _ in range(8)]
    request = gen_pb.GenerateRequest(token_ids=gen_pb.TokenIds(ids=PREFIX + suffix),
                                     sampling=gen_pb.SamplingParams(max_tokens=1, temperature=0.0))
    call = gen.GenerateStream(request, timeout=T)
    list(call)
    return dict(call.trailing_metadata())["x-kvroute-replica"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, default_model_dir):
    config = ClusterConfig(
        replicas=2, router_port=0, router_http_port=-1, model=str(default_model_dir),
        log_dir=str(tmp_path_factory.mktemp("frozen")),
        replica_args=("--heartbeat-interval", str(HEARTBEAT)), router_args=("--heartbeat-poll-interval", "0.1"),
    )
    local = LocalCluster(config, log=lambda *a, **k: None).start()
    try:
        yield local
    finally:
        local.stop()


def test_a_frozen_serving_process_stops_heartbeating_and_its_calls_go_to_the_other_replica(cluster):
    heartbeats = redis.Redis.from_url(cluster.redis_url)
    layout = RedisLayout()
    with grpc.insecure_channel(cluster.router_target) as channel:
        gen = gen_grpc.GenerationServiceStub(channel)
        scorer = router_grpc.RouterServiceStub(channel)

        def pick() -> str:  # what the router would pick for the prefix now (no call is sent)
            score = scorer.Score(router_pb.ScoreRequest(token_ids=gen_pb.TokenIds(ids=PREFIX)), timeout=T)
            return score.picked_replica_id

        def routable() -> set[str]:
            score = scorer.Score(router_pb.ScoreRequest(token_ids=gen_pb.TokenIds(ids=PREFIX)), timeout=T)
            return {r.replica_id for r in score.replicas if r.routable}

        warm = served_by(gen, 0)
        wait_for(lambda: all(served_by(gen, s) == warm for s in (1, 2)), timeout=T, what="the prefix indexed")
        frozen = next(c for c in cluster.replicas if c.name == warm)
        other = next(c.name for c in cluster.replicas if c.name != warm)
        key = layout.heartbeat_key(warm)
        assert heartbeats.exists(key)

        os.kill(frozen.pid, signal.SIGSTOP)  # the serving process only: its engine process runs on
        try:
            wait_for(lambda: not heartbeats.exists(key), timeout=4 * TTL, what=f"{warm}'s heartbeat to expire")
            assert heartbeats.exists(layout.heartbeat_key(other))
            wait_for(lambda: pick() == other, timeout=T, what="the router dropping the frozen replica")
            assert [served_by(gen, s) for s in range(3, 8)] == [other] * 5
            assert not heartbeats.exists(key), "no heartbeat while the serving process is frozen"
        finally:
            os.kill(frozen.pid, signal.SIGCONT)
        wait_for(lambda: heartbeats.exists(key), timeout=4 * TTL, what=f"{warm}'s heartbeats to resume")
        # Both replicas hold the prefix by now (the other one served it meanwhile): back means routable.
        wait_for(lambda: routable() == {warm, other}, timeout=T, what=f"the router routing to {warm} again")
    log = (cluster.log_dir / f"{warm}.log").read_text()
    assert "heartbeats withheld" in log and "heartbeats resume" in log, log[-2000:]
