"""A replica that drains (a graceful stop: SIGTERM, ``ReplicaServer.stop(drain=...)``) says so at
once and gets no new call from any front: the router's gRPC proxy, its HTTP front, and Envoy with
the router as its endpoint picker (replica/server.py, kvroute/heartbeat.py, router/registry.py).

One redis-server, two real replicas (generated default model) and one router whose cost weights
make the pick deterministic: 1,000 prefill tokens/s, 2 ms per running sequence, so a replica
holding a 256-token prefix costs 256 ms less for a prompt that starts with it, and a call running
there adds 2 ms. rep-a holds the prefix of every prompt sent here, so every call would go to it.
rep-a then drains with one long call in flight (its drain lasts while that call runs): the calls
sent meanwhile must all be served by rep-b, none refused by rep-a and retried.

Heartbeats are written every 5 s here, so "at once" means well before the next periodic one.
"""

from __future__ import annotations

import asyncio
import random

import grpc
import httpx2
import pytest
import redis
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from kvroute.heartbeat import Heartbeat
from kvroute.redis_layout import RedisLayout
from kvroute.telemetry import ATTR_REPLICA, setup_telemetry
from kvroute.v1 import generation_pb2 as gen_pb
from kvroute.v1 import generation_pb2_grpc as gen_grpc
from kvroute.v1 import router_pb2 as router_pb
from kvroute_tools.envoy import EnvoyFront
from replica.server import BackgroundReplica
from replica.settings import ReplicaSettings
from router.server import BackgroundRouter
from router.settings import RouterSettings
from tests.integration.test_router_proxy import GREEDY_LONG, ids_request, metric_points
from tests.support import started_stream, wait_for

T = 30.0
HEARTBEAT_S = 5.0
PREFIX = 256  # tokens rep-a holds (16 full blocks)


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 500) for _ in range(n)]


SHARED = prompt(1, PREFIX)


@pytest.fixture(scope="module")
def replicas(redis_server, default_model_dir):
    def settings(rid: str) -> ReplicaSettings:
        return ReplicaSettings(host="127.0.0.1", port=0, http_port=0, model=str(default_model_dir), replica_id=rid,
                               redis_url=redis_server.url, torch_threads=1, heartbeat_interval=HEARTBEAT_S,
                               heartbeat_ttl=3 * HEARTBEAT_S, max_num_seqs=4)

    with BackgroundReplica(settings("rep-a")) as a, BackgroundReplica(settings("rep-b")) as b:
        yield {"rep-a": a, "rep-b": b}


@pytest.fixture(scope="module")
def metric_reader():
    return InMemoryMetricReader()


@pytest.fixture(scope="module")
def router(redis_server, default_model_dir, replicas, metric_reader):
    telemetry = setup_telemetry("kvroute-router-test", otlp=False, metric_readers=[metric_reader])
    settings = RouterSettings(
        host="127.0.0.1", port=0, http_port=0, picker_port=0, redis_url=redis_server.url,
        model=str(default_model_dir), seed=0, heartbeat_poll_interval=0.05, prefill_tokens_per_s=1000.0,
        decode_seconds_per_running=0.002, kv_usage_weight=0.0, kv_footprint_weight=0.0, speculative_ttl=0.0,
    )
    with BackgroundRouter(settings, telemetry=telemetry) as r:
        wait_for(lambda: {i.replica_id for i in r.server.registry.routable()} == set(replicas), what="replicas routable")
        yield r
    telemetry.shutdown()


@pytest.fixture(scope="module")
def envoy(router, tmp_path_factory):
    with EnvoyFront(router.target, picker_target=router.picker_target, folder=tmp_path_factory.mktemp("envoy")) as e:
        yield e


def heartbeat(redis_server, replica_id: str) -> Heartbeat:
    with redis.Redis.from_url(redis_server.url) as client:
        return Heartbeat.from_redis(client.hgetall(RedisLayout().heartbeat_key(replica_id)))


def served_by(gen, ids) -> str:
    """The replica that served one call of ``ids`` (the routing trailer both gRPC fronts set)."""
    call = gen.GenerateStream(ids_request(ids, gen_pb.SamplingParams(max_tokens=1, temperature=0.0)), timeout=T)
    list(call)
    return dict(call.trailing_metadata())["x-kvroute-replica"]


def matched_blocks(router, replica_id: str, ids) -> int:
    scored = router.server.routing.score(router_pb.ScoreRequest(token_ids=gen_pb.TokenIds(ids=ids)))
    return next((r.gpu_matched_blocks for r in scored.replicas if r.replica_id == replica_id), 0)


def retries_on(reader, replica_id: str) -> int:
    """The proxy's retries after a failed attempt on ``replica_id``."""
    return sum(p.value for p in metric_points(reader, "kvroute.router.retries")
               if p.attributes.get(ATTR_REPLICA) == replica_id)


def test_a_draining_replica_says_so_at_once_and_no_front_sends_it_a_new_call(
        redis_server, replicas, router, envoy, metric_reader):
    a, b = replicas["rep-a"], replicas["rep-b"]
    with grpc.insecure_channel(a.target) as ch_a, grpc.insecure_channel(router.target) as ch_proxy, \
            grpc.insecure_channel(envoy.target) as ch_envoy:
        direct_a = gen_grpc.GenerationServiceStub(ch_a)
        fronts = {"proxy": gen_grpc.GenerationServiceStub(ch_proxy), "envoy": gen_grpc.GenerationServiceStub(ch_envoy)}
        list(direct_a.GenerateStream(ids_request(SHARED + [7], gen_pb.SamplingParams(max_tokens=1)), timeout=T))
        wait_for(lambda: matched_blocks(router, "rep-a", SHARED) == PREFIX // 16, what="rep-a's prefix indexed")
        for name, gen in fronts.items():  # before the drain, the prefix takes every call to rep-a
            assert served_by(gen, SHARED + prompt(3, 8)) == "rep-a", name
        retried_before = retries_on(metric_reader, "rep-a")

        held = started_stream(direct_a, ids_request(SHARED + prompt(4, 8), GREEDY_LONG), 1, timeout=T)
        stopping = asyncio.run_coroutine_threadsafe(a.server.stop(grace=1.0, drain=T), a.loop)
        try:
            beat = wait_for(lambda: (hb := heartbeat(redis_server, "rep-a")).draining and hb,
                            timeout=HEARTBEAT_S / 2, what="rep-a's heartbeat saying draining")
            assert beat.address == a.target
            info = wait_for(lambda: (i := router.server.registry.get("rep-a")) is not None and i.draining and i,
                            timeout=HEARTBEAT_S / 2, what="the router seeing rep-a drain")
            assert not info.routable and "draining" in info.reason, info
            assert [i.replica_id for i in router.server.registry.routable()] == ["rep-b"]
            assert not heartbeat(redis_server, "rep-b").draining

            health = httpx2.get(f"http://127.0.0.1:{a.server.http_port}/health", timeout=T)
            assert health.status_code == 503
            assert "draining" in health.json()["reason"], health.json()

            for k in range(3):
                for name, gen in fronts.items():
                    assert served_by(gen, SHARED + prompt(10 + k, 8)) == "rep-b", name
                resp = httpx2.post(f"http://127.0.0.1:{router.server.http_port}/v1/completions", timeout=T, json={
                    "model": b.server.model_name, "prompt": SHARED + prompt(20 + k, 8), "max_tokens": 1,
                    "temperature": 0.0})
                assert resp.status_code == 200, resp.text
                assert resp.headers["x-kvroute-replica"] == "rep-b"
            assert retries_on(metric_reader, "rep-a") == retried_before  # the proxy never tried rep-a
            assert a.server.frontend.num_in_flight == 1  # rep-a was draining all along
        finally:
            held.cancel()
            stopping.result(T)
