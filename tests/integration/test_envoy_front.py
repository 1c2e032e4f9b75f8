"""A real Envoy in front of real replicas, the router as its endpoint picker (router.picker,
kvroute_tools.envoy): what the client sees through Envoy against the proxy and the replica direct.

One redis-server, two real replicas (generated default model, 128 KV blocks, max_num_seqs 4) and one
seeded router with an in-memory metric reader per module, Envoy on loopback. Covered: deltas as the
replica sends them (the routing trailers added by the picker instead of the final message's
RoutingInfo); the replica's cached tokens reaching the prediction metric through the trailers; bad
prompts refused before anything is picked; a client cancel and an expired deadline reaching the
replica, which frees its blocks; UNAVAILABLE with the reason when nothing is routable; the picker
down -> an error, and no request upstream; 30 concurrent requests sharing a 512-token prefix landing
as through the proxy, counted in flight at the pick and released at the end of each stream
(cancels and errors included); the response trailers reaching the picker for the sampled share
only (``trailers_percent``), every call getting the pick in its trailers all the same; past
``picker_streams`` a call refused at once.

One module on purpose: the cluster's start costs more than the tests.
"""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from kvroute.telemetry import setup_telemetry
from kvroute.v1 import generation_pb2 as gen_pb
from kvroute.v1 import generation_pb2_grpc as gen_grpc
from kvroute_tools.envoy import EnvoyFront
from kvroute_tools.redis_server import free_port
from replica.server import BackgroundReplica
from replica.settings import ReplicaSettings
from router.server import BackgroundRouter
from router.settings import RouterSettings
from tests.integration.test_router_proxy import GREEDY_LONG, all_idle, ids_request, metric_points, strip
from tests.support import deltas_before_deadline, started_stream, wait_for

B = 16
T = 30.0


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 500) for _ in range(n)]


@pytest.fixture(scope="module")
def replicas(redis_server, default_model_dir):
    def settings(rid: str) -> ReplicaSettings:
        return ReplicaSettings(host="127.0.0.1", port=0, model=str(default_model_dir), replica_id=rid,
                               redis_url=redis_server.url, num_blocks=128, torch_threads=1, heartbeat_interval=0.2,
                               heartbeat_ttl=5.0, max_num_seqs=4)  # a stalled test process is no dead replica

    with BackgroundReplica(settings("rep-a")) as a, BackgroundReplica(settings("rep-b")) as b:
        yield {"rep-a": a, "rep-b": b}


def router_settings(redis_server, model_dir, **kw) -> RouterSettings:
    return RouterSettings(**{**dict(host="127.0.0.1", port=0, redis_url=redis_server.url, model=str(model_dir),
                                    seed=0, heartbeat_poll_interval=0.1, picker_port=0), **kw})


@pytest.fixture(scope="module")
def metric_reader():
    return InMemoryMetricReader()


@pytest.fixture(scope="module")
def router(redis_server, default_model_dir, replicas, metric_reader):
    telemetry = setup_telemetry("kvroute-router-test", otlp=False, metric_readers=[metric_reader])
    with BackgroundRouter(router_settings(redis_server, default_model_dir), telemetry=telemetry) as r:
        wait_for(lambda: {i.replica_id for i in r.server.registry.routable()} == set(replicas), what="replicas routable")
        yield r
    telemetry.shutdown()


@pytest.fixture(scope="module")
def envoy(router, tmp_path_factory):
    with EnvoyFront(router.target, picker_target=router.picker_target, folder=tmp_path_factory.mktemp("envoy"),
                    trailers_percent=100) as e:
        yield e


@pytest.fixture(scope="module")
def via_envoy(envoy):
    with grpc.insecure_channel(envoy.target) as ch:
        yield gen_grpc.GenerationServiceStub(ch)


@pytest.fixture(scope="module")
def via_proxy(router):
    with grpc.insecure_channel(router.target) as ch:
        yield gen_grpc.GenerationServiceStub(ch)


def released(router) -> bool:
    return router.server.load.local() == {}


def test_stream_is_the_replicas_deltas_with_the_pick_in_the_trailers(via_envoy, replicas, router):
    ids = prompt(1, 3 * B + 5)
    call = via_envoy.GenerateStream(ids_request(ids), timeout=T)
    through = list(call)
    trailers = dict(call.trailing_metadata())
    picked = replicas[trailers["x-kvroute-replica"]]
    direct = list(gen_grpc.GenerationServiceStub(grpc.insecure_channel(picked.target)).GenerateStream(
        ids_request(ids), timeout=T))
    assert len(through) == len(direct) > 1
    assert [strip(d) for d in through] == [strip(d) for d in direct]
    assert through[-1].usage.completion_tokens == 12
    assert trailers["x-kvroute-predicted-cached-tokens"] == "0"
    assert trailers["x-kvroute-cached-tokens"] == str(through[-1].usage.cached_tokens)
    wait_for(lambda: released(router), what="the pick's load released")


def test_replica_cached_tokens_reach_the_prediction_metric_through_the_trailers(via_envoy, router, metric_reader):
    ids = prompt(2, 4 * B + 1)
    first = list(via_envoy.GenerateStream(ids_request(ids), timeout=T))[-1]
    call = via_envoy.GenerateStream(ids_request(ids), timeout=T)
    second = list(call)[-1]
    assert first.usage.cached_tokens == 0 and second.usage.cached_tokens == 4 * B
    assert dict(call.trailing_metadata())["x-kvroute-predicted-cached-tokens"] == str(4 * B)

    def cached_total():
        return sum(p.value for p in metric_points(metric_reader, "kvroute.router.prediction.cached_tokens"))

    wait_for(lambda: cached_total() >= 4 * B, what="the cached tokens recorded")


def test_bad_request_is_invalid_argument_naming_the_field_and_picks_nothing(via_envoy, router, envoy):
    before = envoy.stats("cluster.kvroute_replicas.upstream_rq_total").get("cluster.kvroute_replicas.upstream_rq_total", 0)
    for request, field in [(gen_pb.GenerateRequest(), "prompt"), (ids_request([1, 100000, 2]), "prompt.token_ids"),
                           (gen_pb.GenerateRequest(text=""), "prompt"),
                           (ids_request([1, 2, 3], gen_pb.SamplingParams(max_tokens=0)), "max_tokens"),
                           (ids_request([1] * 9000), "prompt"),  # longer than the model holds
                           # Under the model folder's 8192, but no replica holds it: their heartbeats
                           # say 2032 (128 blocks of 16, the null block excluded).
                           (ids_request([1] * 2032), "prompt")]:
        with pytest.raises(grpc.RpcError) as err:
            list(via_envoy.GenerateStream(request, timeout=T))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith(f"{field}: "), err.value.details()
    assert "the model holds at most 2032 tokens" in err.value.details()
    assert envoy.stats("cluster.kvroute_replicas.upstream_rq_total")["cluster.kvroute_replicas.upstream_rq_total"] == before
    assert released(router)


def test_client_cancel_and_deadline_expiry_reach_the_replica_and_free_its_blocks(via_envoy, replicas, router):
    stream = started_stream(via_envoy, ids_request(prompt(9, 40), GREEDY_LONG), 3, timeout=T)
    assert not all_idle(replicas)
    stream.cancel()
    wait_for(lambda: all_idle(replicas), what="replicas idle after the cancel")
    wait_for(lambda: released(router), what="the cancelled call's load released")

    stream = via_envoy.GenerateStream(ids_request(prompt(10, 40), GREEDY_LONG), timeout=1.0)
    received = deltas_before_deadline(stream)
    assert 0 < received < 2000
    wait_for(lambda: all_idle(replicas), what="replicas idle after the deadline")
    wait_for(lambda: released(router), what="the expired call's load released")


def test_no_routable_replica_is_unavailable_with_the_reason(redis_server, default_model_dir, replicas, tmp_path):
    with BackgroundRouter(router_settings(redis_server, default_model_dir, block_size=32)) as other, \
            EnvoyFront(other.target, picker_target=other.picker_target, folder=tmp_path) as front, grpc.insecure_channel(front.target) as ch:
        wait_for(lambda: len(other.server.registry.all()) == 2, what="heartbeats seen")
        with pytest.raises(grpc.RpcError) as err:
            list(gen_grpc.GenerationServiceStub(ch).GenerateStream(ids_request(prompt(8, 64)), timeout=T))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert err.value.details().startswith("no replica is routable"), err.value.details()
    assert "block_size 16 != router's 32" in err.value.details()


def test_picker_down_is_an_error_and_nothing_goes_upstream(replicas, tmp_path):
    with EnvoyFront(f"127.0.0.1:{free_port()}", picker_target=f"127.0.0.1:{free_port()}", folder=tmp_path) as front, grpc.insecure_channel(front.target) as ch:
        with pytest.raises(grpc.RpcError) as err:
            list(gen_grpc.GenerationServiceStub(ch).GenerateStream(ids_request(prompt(3, 40)), timeout=T))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # status_on_error 503, not a replica's answer
        assert front.stats("cluster.kvroute_replicas.upstream_rq_total").get(
            "cluster.kvroute_replicas.upstream_rq_total", 0) == 0
    assert all_idle(replicas)


async def _burst(target: str, prefix: list[int], *, cancel: int, bad: int, router) -> tuple[dict[str, int], int]:
    """30 streams sharing ``prefix`` opened at once; once all 30 are counted in flight, ``cancel`` of
    them are cancelled; ``bad`` more calls are refused by the replica after the pick (top_p 1.5).
    Returns ({replica: completed streams}, the peak in-flight count the router saw)."""
    sampling = gen_pb.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    async with grpc.aio.insecure_channel(target) as ch:
        stub = gen_grpc.GenerationServiceStub(ch)
        calls = [stub.GenerateStream(ids_request(prefix + prompt(100 + i, B), sampling), timeout=T) for i in range(30)]
        bad_calls = [stub.GenerateStream(ids_request(prefix + prompt(200 + i, B), gen_pb.SamplingParams(top_p=1.5)),
                                         timeout=T) for i in range(bad)]

        async def drain(call):
            try:
                msgs = [m async for m in call]
            except grpc.aio.AioRpcError as e:
                return e.code().name, ""
            except asyncio.CancelledError:  # the call, cancelled by us (not this task)
                return "CANCELLED", ""
            md = dict(await call.trailing_metadata())
            return "OK", md.get("x-kvroute-replica") or msgs[-1].routing.replica_id

        tasks = [asyncio.ensure_future(drain(c)) for c in calls]
        peak = 0
        for _ in range(200):  # until every stream is counted (the replicas run 4 at a time each)
            peak = max(peak, sum(f for f, _ in router.server.load.local().values()))
            if peak >= 30:
                break
            await asyncio.sleep(0.02)
        for c in calls[:cancel]:
            c.cancel()
        results = await asyncio.gather(*tasks)
        bad_results = [await drain(c) for c in bad_calls]
    assert [code for code, _ in bad_results] == ["INVALID_ARGUMENT"] * bad
    landed: dict[str, int] = {}
    for code, rid in results[cancel:]:
        assert code == "OK"
        landed[rid] = landed.get(rid, 0) + 1
    return landed, peak


@pytest.mark.parametrize("front", ["proxy", "envoy"])
def test_thirty_concurrent_requests_sharing_a_prefix_land_on_one_replica_counted_at_the_pick(
        front, router, envoy, replicas):
    target = router.target if front == "proxy" else envoy.target
    prefix = prompt(500 + (front == "envoy"), 32 * B)
    landed, peak = asyncio.run(_burst(target, prefix, cancel=5, bad=2, router=router))
    assert sum(landed.values()) == 25 and len(landed) == 1, landed
    assert peak >= 30  # counted in flight at the pick: more than the replicas run at once (8)
    wait_for(lambda: released(router), what="every stream's load released (cancels and errors included)")
    wait_for(lambda: all_idle(replicas), what="replicas idle")


def test_unsampled_calls_get_the_pick_in_their_trailers_and_skip_the_picker(via_envoy, router, metric_reader,
                                                                             tmp_path):
    """trailers_percent 0: the response trailers never reach the picker (no prediction recorded), yet
    Envoy adds the pick from the picker's metadata, and the load is released when the stream ends."""
    ids = prompt(20, 4 * B + 3)
    list(via_envoy.GenerateStream(ids_request(ids), timeout=T))  # the prefix is cached somewhere now
    wait_for(lambda: released(router), what="the first call's load released")

    def recorded():
        return sum(p.value for p in metric_points(metric_reader, "kvroute.router.prediction.cached_tokens"))

    before = recorded()
    with EnvoyFront(router.target, picker_target=router.picker_target, folder=tmp_path, trailers_percent=0) as front, \
            grpc.insecure_channel(front.target) as ch:
        call = gen_grpc.GenerationServiceStub(ch).GenerateStream(ids_request(ids), timeout=T)
        last = list(call)[-1]
        trailers = dict(call.trailing_metadata())
        sent = front.stats("http.kvroute.ext_proc.stream_msgs_sent")["http.kvroute.ext_proc.stream_msgs_sent"]
    assert sent == 1  # the body: no trailers message
    assert last.usage.cached_tokens == 4 * B
    assert trailers["x-kvroute-cached-tokens"] == str(4 * B)  # the replica's own
    assert trailers["x-kvroute-predicted-cached-tokens"] == str(4 * B)  # Envoy's, from the picker's metadata
    assert trailers["x-kvroute-replica"] in ("rep-a", "rep-b")
    wait_for(lambda: released(router), what="the unsampled call's load released with its stream")
    assert recorded() == before


def test_past_its_stream_limit_the_picker_refuses_at_once(redis_server, default_model_dir, replicas, tmp_path):
    """picker_streams 1: a second call while one is in flight is refused at once with
    RESOURCE_EXHAUSTED naming the limit (no queue, no hang), and goes through once the first ended."""
    import time

    with BackgroundRouter(router_settings(redis_server, default_model_dir, picker_streams=1)) as one, \
            EnvoyFront(one.target, picker_target=one.picker_target, folder=tmp_path) as front, \
            grpc.insecure_channel(front.target) as ch:
        gen = gen_grpc.GenerationServiceStub(ch)
        wait_for(lambda: len(one.server.registry.routable()) == 2, what="replicas routable")
        held = started_stream(gen, ids_request(prompt(21, 40), GREEDY_LONG), 1, timeout=T)
        t0 = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            list(gen.GenerateStream(ids_request(prompt(22, 40)), timeout=T))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert err.value.details() == ("endpoint picker: the calls in flight are at its limit, picker_streams=1;"
                                       " retry later")
        assert time.monotonic() - t0 < 1.5  # refused, not queued until the picker's 2 s message timeout
        held.cancel()
        wait_for(lambda: not one.server.load.local(), what="the held call released")
        assert len(list(gen.GenerateStream(ids_request(prompt(23, 40)), timeout=T))) > 1


def test_a_sampled_share_of_the_calls_sends_its_trailers_to_the_picker(router, tmp_path):
    n = 40
    with EnvoyFront(router.target, picker_target=router.picker_target, folder=tmp_path, trailers_percent=50) as front, \
            grpc.insecure_channel(front.target) as ch:
        gen = gen_grpc.GenerationServiceStub(ch)
        for i in range(n):
            list(gen.GenerateStream(ids_request(prompt(100 + i, 20), gen_pb.SamplingParams(max_tokens=1)), timeout=T))
        sent = front.stats("http.kvroute.ext_proc.stream_msgs_sent")["http.kvroute.ext_proc.stream_msgs_sent"]
    assert 5 < sent - n < n - 5  # one body each, and the trailers of about half (Binomial(40, 0.5))
