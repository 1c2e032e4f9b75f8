"""The router's gRPC proxy and RouterService over real gRPC on loopback (router/proxy.py, DESIGN.md §5).

One real redis-server, two real replicas (BackgroundReplica: generated default model, 128 KV
blocks, heartbeats every 0.2 s; ``rep-b`` queues at most 2 requests) and one seeded router
(BackgroundRouter) per module, all with in-memory span and metric exporters; a few tests start a
second router with other settings (hash-incompatible, static discovery of rep-b alone). Covered:
deltas passed through unchanged, routing info and trailing metadata, Score vs the proxy's pick,
SetPolicy, retry on a dead replica before the first token, UNAVAILABLE with the reason,
RESOURCE_EXHAUSTED and INVALID_ARGUMENT passed through, cancel and deadline freeing the replica's
blocks, spans continuing into the replica, the metrics. Every call has a deadline.

One module on purpose: every test runs against that one module-scoped cluster, whose start costs
more than the tests; split, it would start once per file.
"""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from kvroute.telemetry import setup_telemetry
from kvroute.v1 import generation_pb2 as gen_pb
from kvroute.v1 import generation_pb2_grpc as gen_grpc
from kvroute.v1 import replica_pb2 as rep_pb
from kvroute.v1 import replica_pb2_grpc as rep_grpc
from kvroute.v1 import router_pb2 as router_pb
from kvroute.v1 import router_pb2_grpc as router_grpc
from replica.server import BackgroundReplica
from replica.settings import ReplicaSettings
from router.consumer_feed import REJECT_REASONS
from router.server import BackgroundRouter
from router.settings import RouterSettings
from tests.support import deltas_before_deadline, started_stream, wait_for
from tests.support_redis import unreachable_replica

B = 16
T = 30.0  # deadline of every call
ADMIN_TOKEN = "test-admin-token"
ADMIN = (("authorization", f"Bearer {ADMIN_TOKEN}"),)  # SetPolicy's credentials on the module's router
GREEDY = gen_pb.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
GREEDY_LONG = gen_pb.SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 500) for _ in range(n)]


def ids_request(ids, sampling=GREEDY, **kw) -> gen_pb.GenerateRequest:
    return gen_pb.GenerateRequest(token_ids=gen_pb.TokenIds(ids=ids), sampling=sampling, **kw)


# -- the cluster ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def spans():
    return InMemorySpanExporter()


@pytest.fixture(scope="module")
def replicas(redis_server, default_model_dir, spans):
    def settings(rid: str, **kw) -> ReplicaSettings:
        return ReplicaSettings(
            host="127.0.0.1", port=0, model=str(default_model_dir), replica_id=rid, redis_url=redis_server.url,
            num_blocks=128, torch_threads=1, heartbeat_interval=0.2, heartbeat_ttl=5.0, max_num_seqs=4,
            **kw,
        )

    telemetry = setup_telemetry("kvroute-replica-test", otlp=False, span_exporters=[spans])
    with BackgroundReplica(settings("rep-a"), telemetry=telemetry) as a, \
            BackgroundReplica(settings("rep-b", max_waiting=2), telemetry=telemetry) as b:
        yield {"rep-a": a, "rep-b": b}
    telemetry.shutdown()


def router_settings(redis_server, model_dir, **kw) -> RouterSettings:
    base = dict(host="127.0.0.1", port=0, redis_url=redis_server.url, model=str(model_dir), seed=0,
                heartbeat_poll_interval=0.1, load_sync_interval=0.1)
    return RouterSettings(**{**base, **kw})


@pytest.fixture(scope="module")
def metric_reader():
    return InMemoryMetricReader()


@pytest.fixture(scope="module")
def router(redis_server, default_model_dir, replicas, spans, metric_reader):
    telemetry = setup_telemetry("kvroute-router-test", otlp=False, span_exporters=[spans],
                                metric_readers=[metric_reader])
    settings = router_settings(redis_server, default_model_dir, admin_token=ADMIN_TOKEN)
    with BackgroundRouter(settings, telemetry=telemetry) as r:
        wait_for(lambda: {i.replica_id for i in r.server.registry.routable()} == set(replicas),
                 what="both replicas routable")
        yield r
    telemetry.shutdown()


@pytest.fixture(scope="module")
def grpc_target(router) -> str:
    return router.target  # conftest's channel / gen connect here


@pytest.fixture(scope="module")
def rs(channel):
    return router_grpc.RouterServiceStub(channel)


def replica_stub(replica) -> rep_grpc.ReplicaServiceStub:
    return rep_grpc.ReplicaServiceStub(grpc.insecure_channel(replica.target))


def all_idle(replicas) -> bool:
    for r in replicas.values():
        load = replica_stub(r).GetLoad(rep_pb.GetLoadRequest(), timeout=T)
        if load.running or load.waiting or load.kv_usage != 0.0 or r.server.frontend.num_in_flight:
            return False
    return True


def score(rs, ids) -> router_pb.ScoreResponse:
    return rs.Score(router_pb.ScoreRequest(token_ids=gen_pb.TokenIds(ids=ids)), timeout=T)


def by_id(resp: router_pb.ScoreResponse) -> dict[str, router_pb.ReplicaScore]:
    return {r.replica_id: r for r in resp.replicas}


def strip(d: gen_pb.GenerateResponse) -> gen_pb.GenerateResponse:
    """A delta without what legitimately differs between two runs of the same prompt."""
    d = gen_pb.GenerateResponse.FromString(d.SerializeToString())
    d.request_id = ""
    d.ClearField("routing")
    if d.HasField("usage"):
        d.usage.cached_tokens = 0
    return d


# -- streaming and routing info ------------------------------------------------------------------------
def test_stream_passes_the_replica_deltas_through_unchanged(gen, replicas):
    ids = prompt(1, 3 * B + 5)
    via_router = list(gen.GenerateStream(ids_request(ids), timeout=T))
    picked = replicas[via_router[-1].routing.replica_id]
    direct = list(gen_grpc.GenerationServiceStub(grpc.insecure_channel(picked.target)).GenerateStream(
        ids_request(ids), timeout=T))
    assert len(via_router) == len(direct) > 1
    assert [strip(d) for d in via_router] == [strip(d) for d in direct]
    assert all(not d.HasField("routing") for d in via_router[:-1])
    assert via_router[-1].usage.completion_tokens == 12


def test_final_message_carries_routing_info_and_trailing_metadata(gen, replicas):
    ids = prompt(2, 3 * B + 5)
    call = gen.GenerateStream(ids_request(ids), timeout=T)
    deltas = list(call)
    routing = deltas[-1].routing
    assert routing.replica_id in replicas
    assert routing.replica_address == replicas[routing.replica_id].server.address
    assert routing.policy == "kvroute"
    assert routing.predicted_cached_tokens == 0  # a prompt nobody has seen
    trailing = dict(call.trailing_metadata())
    assert trailing["x-kvroute-replica"] == routing.replica_id
    assert trailing["x-kvroute-predicted-cached-tokens"] == "0"

    # The same prompt again: predicted from the index, and the replica agrees.
    again, call = gen.Generate.with_call(ids_request(ids), timeout=T)
    assert again.routing.replica_id == routing.replica_id
    assert again.routing.predicted_cached_tokens == 3 * B == again.usage.cached_tokens
    assert dict(call.trailing_metadata())["x-kvroute-predicted-cached-tokens"] == str(3 * B)
    assert list(again.token_ids) == [t for d in deltas for t in d.token_ids]


def test_cache_salt_keeps_tenants_apart_and_predictions_hold(gen):
    ids = prompt(13, 4 * B + 1)
    first = gen.Generate(ids_request(ids, cache_salt="tenant-a"), timeout=T)
    same = gen.Generate(ids_request(ids, cache_salt="tenant-a"), timeout=T)
    other = gen.Generate(ids_request(ids, cache_salt="tenant-b"), timeout=T)
    assert first.routing.predicted_cached_tokens == 0 == first.usage.cached_tokens
    assert same.routing.predicted_cached_tokens == 4 * B == same.usage.cached_tokens
    assert other.routing.predicted_cached_tokens == 0 == other.usage.cached_tokens


def test_get_model_info_is_the_replicas(gen, replicas):
    info = gen.GetModelInfo(gen_pb.GetModelInfoRequest(), timeout=T)
    direct = gen_grpc.GenerationServiceStub(grpc.insecure_channel(replicas["rep-a"].target)).GetModelInfo(
        gen_pb.GetModelInfoRequest(), timeout=T)
    assert info == direct

def test_health_and_reflection(channel):
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "readiness", "liveness", "kvroute.v1.GenerationService", "kvroute.v1.RouterService"):
        assert health.Check(health_pb2.HealthCheckRequest(service=service), timeout=T).status == \
            health_pb2.HealthCheckResponse.SERVING
    services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert {"kvroute.v1.GenerationService", "kvroute.v1.RouterService", "grpc.health.v1.Health"} <= services


# -- Score and SetPolicy ----------------------------------------------------------------------------------
def test_score_returns_per_replica_data_and_the_pick_the_proxy_makes(gen, rs, replicas):
    base = prompt(3, 6 * B)
    first = gen.Generate(ids_request(base), timeout=T)
    holder = first.routing.replica_id
    other = next(r for r in replicas if r != holder)
    follow_up = base + prompt(4, 2 * B + 3)
    wait_for(lambda: by_id(score(rs, follow_up))[holder].speculative_matched_blocks == 0,
             what="the holder's blocks indexed from its events")
    resp = score(rs, follow_up)
    assert resp.prompt_tokens == len(follow_up) and resp.num_blocks == len(follow_up) // B
    assert resp.policy == "kvroute" and resp.picked_replica_id == holder
    scores = by_id(resp)
    assert set(scores) == set(replicas)
    assert scores[holder].gpu_matched_blocks == 6 and scores[other].gpu_matched_blocks == 0
    assert all(s.routable and not s.reason and s.cpu_matched_blocks == 0 for s in scores.values())
    assert scores[holder].cost < scores[other].cost
    assert scores[holder].address == replicas[holder].server.address

    routed = gen.Generate(ids_request(follow_up), timeout=T)
    assert routed.routing.replica_id == resp.picked_replica_id
    assert routed.routing.predicted_cached_tokens == 6 * B == routed.usage.cached_tokens


def test_set_policy_switches_to_round_robin_and_back(gen, rs):
    assert rs.SetPolicy(router_pb.SetPolicyRequest(policy="round_robin"), timeout=T,
                        metadata=ADMIN).policy == "round_robin"
    try:
        ids = prompt(5, 4 * B)
        picks = [gen.Generate(ids_request(ids), timeout=T).routing for _ in range(4)]
        assert {p.policy for p in picks} == {"round_robin"}
        order = [p.replica_id for p in picks]
        assert order[0] != order[1] and order[0::2] == [order[0]] * 2 and order[1::2] == [order[1]] * 2, order
    finally:
        assert rs.SetPolicy(router_pb.SetPolicyRequest(policy="kvroute"), timeout=T, metadata=ADMIN).policy == "kvroute"
    assert score(rs, prompt(6, B)).policy == "kvroute"
    with pytest.raises(grpc.RpcError) as err:
        rs.SetPolicy(router_pb.SetPolicyRequest(policy="fastest"), timeout=T, metadata=ADMIN)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("policy: unknown 'fastest'")


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer wrong"),),
                                      (("authorization", ADMIN_TOKEN),)], ids=["none", "wrong", "no-bearer"])
def test_set_policy_without_the_admin_token_is_unauthenticated(rs, metadata):
    with pytest.raises(grpc.RpcError) as err:
        rs.SetPolicy(router_pb.SetPolicyRequest(policy="round_robin"), timeout=T, metadata=metadata)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "authorization: Bearer <admin token>" in err.value.details()
    assert score(rs, prompt(6, B)).policy == "kvroute"


# -- failures ---------------------------------------------------------------------------------------------
@pytest.fixture()
def dead_replica(redis_server, rs):
    """A replica that published its cache (8 blocks of a prompt) and a heartbeat, at an address
    nobody listens on: the router's best pick for that prompt, until its heartbeat expires."""
    ids = prompt(7, 8 * B + 1)
    with unreachable_replica(redis_server.url, "rep-dead", ids):
        wait_for(lambda: by_id(score(rs, ids)).get("rep-dead", router_pb.ReplicaScore()).gpu_matched_blocks == 8,
                 what="the dead replica's blocks indexed")
        yield ids
    wait_for(lambda: "rep-dead" not in by_id(score(rs, ids)), what="the dead replica expired")


def test_retry_before_the_first_token_on_a_dead_replica_succeeds_on_another(gen, rs, dead_replica, replicas,
                                                                              metric_reader):
    assert score(rs, dead_replica).picked_replica_id == "rep-dead"
    resp = gen.Generate(ids_request(dead_replica), timeout=T)
    assert resp.routing.replica_id in replicas
    assert resp.usage.completion_tokens == 12
    # Recorded right after the call ends (off the response path).
    retries = wait_for(lambda: metric_points(metric_reader, "kvroute.router.retries"), what="the retry recorded")
    assert [(p.attributes["kvroute.replica_id"], p.attributes["rpc.grpc.status_code"], p.value)
            for p in retries] == [("rep-dead", "UNAVAILABLE", 1)]


def test_no_routable_replica_is_unavailable_with_the_reason(redis_server, default_model_dir, replicas):
    settings = router_settings(redis_server, default_model_dir, block_size=32)
    with BackgroundRouter(settings) as other:
        wait_for(lambda: len(other.server.registry.all()) == 2, what="heartbeats seen")
        with grpc.insecure_channel(other.target) as ch:
            scores = router_grpc.RouterServiceStub(ch).Score(
                router_pb.ScoreRequest(token_ids=gen_pb.TokenIds(ids=prompt(8, 64))), timeout=T)
            assert scores.picked_replica_id == ""
            assert all(not s.routable and "block_size 16 != router's 32" in s.reason for s in scores.replicas)
            with pytest.raises(grpc.RpcError) as denied:  # no admin token on this router: SetPolicy is off
                router_grpc.RouterServiceStub(ch).SetPolicy(router_pb.SetPolicyRequest(policy="round_robin"),
                                                            timeout=T, metadata=ADMIN)
            assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert "SetPolicy is off on this router" in denied.value.details()
            with pytest.raises(grpc.RpcError) as err:
                list(gen_grpc.GenerationServiceStub(ch).GenerateStream(ids_request(prompt(8, 64)), timeout=T))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert err.value.details().startswith("no replica is routable")
    assert "block_size 16 != router's 32" in err.value.details()


def test_resource_exhausted_from_the_replica_is_passed_through(redis_server, default_model_dir, replicas):
    # Static discovery of rep-b alone (max_waiting=2): a concurrent burst overflows its queue.
    settings = router_settings(redis_server, default_model_dir, discovery="static",
                               replicas=replicas["rep-b"].server.address)

    async def burst(target: str) -> list[str]:
        async with grpc.aio.insecure_channel(target) as ch:
            stub = gen_grpc.GenerationServiceStub(ch)

            async def one(i: int) -> str:
                try:
                    deltas = [d async for d in stub.GenerateStream(
                        ids_request(prompt(100 + i, 40), gen_pb.SamplingParams(max_tokens=4, temperature=0.0)),
                        timeout=T)]
                except grpc.aio.AioRpcError as e:
                    assert e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or e.details().startswith(
                        "waiting queue is full"), e.details()
                    return e.code().name
                assert deltas[-1].routing.replica_id == "rep-b"
                return "OK"

            return await asyncio.gather(*(one(i) for i in range(24)))

    with BackgroundRouter(settings) as other:
        wait_for(lambda: [i.replica_id for i in other.server.registry.routable()] == ["rep-b"], what="rep-b only")
        outcomes = asyncio.run(burst(other.target))
    assert set(outcomes) == {"OK", "RESOURCE_EXHAUSTED"}, outcomes
    wait_for(lambda: all_idle(replicas), what="replicas idle")


def test_bad_input_is_invalid_argument_naming_the_field(gen, rs, replicas, router):
    vocab = gen.GetModelInfo(gen_pb.GetModelInfoRequest(), timeout=T).vocab_size
    chat = gen_pb.ChatMessages
    cases = [  # (request, field); all refused by the router (the last three with the replica's own check)
        (gen_pb.GenerateRequest(), "prompt"),
        (gen_pb.GenerateRequest(text=""), "prompt"),
        (gen_pb.GenerateRequest(token_ids=gen_pb.TokenIds()), "prompt"),
        (gen_pb.GenerateRequest(chat=chat()), "prompt.chat"),
        (gen_pb.GenerateRequest(chat=chat(messages=[gen_pb.ChatMessage(role="robot", content="hi")])), "prompt.chat"),
        (ids_request([1, vocab, 2]), "prompt.token_ids"),
        (ids_request([1, 2, 3], gen_pb.SamplingParams(max_tokens=0)), "max_tokens"),
        (ids_request([1, 2, 3], gen_pb.SamplingParams(max_tokens=100_000)), "max_tokens"),  # > max_model_len
        (ids_request([1, 2, 3], gen_pb.SamplingParams(top_p=1.5)), "top_p"),
        (ids_request([1] * 5000), "prompt"),
    ]
    for request, field in cases:
        for rpc in (lambda r: gen.Generate(r, timeout=T), lambda r: list(gen.GenerateStream(r, timeout=T))):
            with pytest.raises(grpc.RpcError) as err:
                rpc(request)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (request, err.value.details())
            assert err.value.details().startswith(f"{field}: "), err.value.details()
    # The replica's message, word for word, from the router, which routed nothing.
    direct = gen_grpc.GenerationServiceStub(grpc.insecure_channel(replicas["rep-a"].target))
    bad = ids_request([1, 2, 3], gen_pb.SamplingParams(max_tokens=0))
    with pytest.raises(grpc.RpcError) as mine:
        gen.Generate(bad, timeout=T)
    with pytest.raises(grpc.RpcError) as theirs:
        direct.Generate(bad, timeout=T)
    assert mine.value.details() == theirs.value.details()
    assert "x-kvroute-replica" not in dict(mine.value.trailing_metadata() or ())  # no replica was picked
    with pytest.raises(grpc.RpcError) as err:
        rs.Score(router_pb.ScoreRequest(), timeout=T)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith("prompt: ")
    wait_for(lambda: router.server.load.local() == {}, what="nothing left in flight")


def test_client_cancel_and_deadline_expiry_reach_the_replica_and_free_its_blocks(gen, replicas, router):
    stream = started_stream(gen, ids_request(prompt(9, 40), GREEDY_LONG), 3, timeout=T)
    running = [replica_stub(r).GetLoad(rep_pb.GetLoadRequest(), timeout=T).running for r in replicas.values()]
    assert sorted(running) == [0, 1]
    stream.cancel()
    wait_for(lambda: all_idle(replicas), what="replicas idle after the cancel")

    stream = gen.GenerateStream(ids_request(prompt(10, 40), GREEDY_LONG), timeout=1.0)
    received = deltas_before_deadline(stream)
    assert 0 < received < 2000
    wait_for(lambda: all_idle(replicas), what="replicas idle after the deadline")
    wait_for(lambda: router.server.load.local() == {}, what="the router's in-flight load released")


# -- telemetry ---------------------------------------------------------------------------------------------
def metric_points(reader: InMemoryMetricReader, name: str) -> list:
    data = reader.get_metrics_data()
    out = []
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if m.name == name:
                    out.extend(m.data.data_points)
    return out


def test_spans_continue_from_the_router_into_the_replica(gen, spans):
    spans.clear()
    resp = gen.Generate(ids_request(prompt(11, 2 * B), request_id="traced-1"), timeout=T)

    def router_span():
        return next((s for s in spans.get_finished_spans() if s.name == "kvroute.v1.GenerationService/Generate"), None)

    server = wait_for(router_span, what="the router's span ended")  # ended right after the call
    finished = spans.get_finished_spans()
    assert server.kind == SpanKind.SERVER
    assert server.attributes["kvroute.replica_id"] == resp.routing.replica_id
    assert server.attributes["kvroute.request_id"] == "traced-1"
    client = next(s for s in finished if s.name == "kvroute.v1.ReplicaService/GenerateStream"
                  and s.kind == SpanKind.CLIENT)
    replica = next(s for s in finished if s.name == "kvroute.v1.ReplicaService/GenerateStream"
                   and s.kind == SpanKind.SERVER)
    assert client.parent.span_id == server.context.span_id
    assert replica.parent.span_id == client.context.span_id
    assert replica.context.trace_id == server.context.trace_id


def test_metrics_cover_decisions_overhead_index_events_prediction_and_genai(gen, metric_reader):
    gen.Generate(ids_request(prompt(12, 2 * B)), timeout=T)
    wait_for(lambda: metric_points(metric_reader, "gen_ai.client.token.usage"), what="a request recorded")
    decisions = metric_points(metric_reader, "kvroute.router.decisions")
    assert sum(p.value for p in decisions if p.attributes["kvroute.outcome"] == "routed") > 0
    stages = {p.attributes["kvroute.stage"] for p in metric_points(metric_reader, "kvroute.router.decision.duration")}
    assert stages == {"hash", "lookup", "score", "total"}
    entries = {p.attributes["kvroute.replica_id"]: p.value
               for p in metric_points(metric_reader, "kvroute.router.index.entries")}
    assert set(entries) >= {"rep-a", "rep-b"} and sum(entries.values()) > 0
    assert metric_points(metric_reader, "kvroute.router.events.applied")[0].value > 0
    # every reason is reported, and real replicas send no input the consumer rejects
    rejected = {p.attributes["kvroute.reason"]: p.value for p in metric_points(metric_reader, "kvroute.router.events.rejected")}
    assert rejected == dict.fromkeys(REJECT_REASONS, 0)
    for name in ("kvroute.router.prediction.ratio", "kvroute.router.prediction.predicted_tokens",
                 "gen_ai.server.time_to_first_token", "gen_ai.server.time_per_output_token",
                 "gen_ai.server.request.duration", "kvroute.router.events.seq_gaps", "kvroute.router.events.resyncs", "kvroute.router.events.lag"):
        assert metric_points(metric_reader, name), name
    usage = {p.attributes["gen_ai.token.type"] for p in metric_points(metric_reader, "gen_ai.client.token.usage")}
    assert usage == {"input", "output"}
