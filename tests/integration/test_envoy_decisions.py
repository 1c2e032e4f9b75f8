"""The router's hand-worked routing cases (tests/router/test_decisions.py) through both fronts: the
Python proxy and a real Envoy whose endpoint picker is the router (router.picker, kvroute_tools.envoy).

Three stub replicas (tests/integration/stub_replicas.py: real gRPC servers, real heartbeats and KV
events through Redis, no engine) and one router with the weights the cases were worked with:
block_size 16, 1,000 tokens/s (1 token = 1 ms), 2 ms per running sequence, prefill-work weight 1,
no KV-usage term, so cost(r) = queued + 2 x uncached + 2 x running, in ms. Each case runs once per
front and must give the same pick; which stub answered is the pick the front followed. The
subset hint of the Endpoint Picker Protocol is exercised on the picker's own stream (a gateway sets
it, not a client).
"""

from __future__ import annotations

import random

import grpc
import pytest
from envoy.config.core.v3 import base_pb2 as core_pb
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc

from kvroute.hashing import BlockHasher
from kvroute.heartbeat import EngineLoad
from kvroute.v1 import generation_pb2 as gen_pb
from kvroute.v1 import generation_pb2_grpc as gen_grpc
from kvroute_tools.envoy import EnvoyFront
from router.server import BackgroundRouter
from router.settings import RouterSettings
from tests.integration.stub_replicas import IDLE, StubReplica
from tests.support import wait_for

B = 16
T = 20.0
FRONTS = ("proxy", "envoy")


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 500) for _ in range(n)]


@pytest.fixture(scope="module")
def stubs(redis_server):
    hasher = BlockHasher(block_size=B)
    made = [StubReplica(f"R{i}", redis_server.url, hasher, max_waiting=4) for i in (1, 2, 3)]
    yield {s.replica_id: s for s in made}
    for s in made:
        s.close()


@pytest.fixture(scope="module")
def router(redis_server, default_model_dir, stubs):
    settings = RouterSettings(
        host="127.0.0.1", port=0, redis_url=redis_server.url, model=str(default_model_dir), seed=7,
        heartbeat_poll_interval=0.05, prefill_tokens_per_s=1000.0, decode_seconds_per_running=0.002,
        prefill_work_weight=1.0, kv_footprint_weight=0.0, kv_usage_weight=0.0, speculative_ttl=0.0, picker_port=0,
    )
    with BackgroundRouter(settings) as r:
        wait_for(lambda: {i.replica_id for i in r.server.registry.routable()} == set(stubs), what="stubs routable")
        yield r


@pytest.fixture(scope="module")
def envoy(router, tmp_path_factory):
    with EnvoyFront(router.target, picker_target=router.picker_target, folder=tmp_path_factory.mktemp("envoy")) as e:
        yield e


@pytest.fixture(scope="module")
def stubs_of(router, envoy):
    channels = {"proxy": grpc.insecure_channel(router.target), "envoy": grpc.insecure_channel(envoy.target)}
    yield {k: gen_grpc.GenerationServiceStub(ch) for k, ch in channels.items()}
    for ch in channels.values():
        ch.close()


@pytest.fixture(autouse=True)
def idle_cluster(stubs, router):
    """Every case starts with idle stubs, nothing in flight, nothing cached (each case uses its own prompts)."""
    for s in stubs.values():
        s.release()
        s.set_load(IDLE)
    wait_for(lambda: all(i.running == i.waiting == i.queued_prefill_tokens == 0 for i in router.server.registry.routable())
             and not router.server.load.local(), what="an idle cluster")
    yield


def generate(gen, ids, salt: str = "") -> tuple[str, grpc.Call]:
    """(the stub that answered, the call: trailing metadata) for one token-id prompt."""
    req = gen_pb.GenerateRequest(token_ids=gen_pb.TokenIds(ids=ids), cache_salt=salt,
                                 sampling=gen_pb.SamplingParams(max_tokens=1))
    call = gen.GenerateStream(req, timeout=T)
    texts = [m.text for m in call]
    return "".join(texts), call


def set_load(router, stub, **load) -> None:
    stub.set_load(EngineLoad(**{**IDLE.__dict__, **load}))
    wait_for(lambda: all(getattr(router.server.registry.get(stub.replica_id), k) == v for k, v in load.items()),
             what=f"{stub.replica_id}'s heartbeat")


def indexed(router, stub, ids, blocks: int, salt: str = "") -> None:
    wait_for(lambda: router.server.routing.score(_score_request(ids, salt)).replicas[
        int(stub.replica_id[1]) - 1].gpu_matched_blocks == blocks, what=f"{stub.replica_id}'s blocks indexed")


def _score_request(ids, salt=""):
    from kvroute.v1 import router_pb2 as router_pb

    return router_pb.ScoreRequest(token_ids=gen_pb.TokenIds(ids=ids), cache_salt=salt)


@pytest.mark.parametrize("front", FRONTS)
def test_nine_disjoint_requests_split_three_ways_counted_at_selection(front, stubs, stubs_of, router):
    gen = stubs_of[front]
    for s in stubs.values():
        s.hold()  # each routed request stays in flight, its 160 tokens unprefilled
    before = {rid: len(s.calls) for rid, s in stubs.items()}
    calls = []
    try:
        for i in range(9):
            calls.append(gen.GenerateStream(gen_pb.GenerateRequest(
                token_ids=gen_pb.TokenIds(ids=prompt(1000 * FRONTS.index(front) + i, 160)),
                sampling=gen_pb.SamplingParams(max_tokens=1)), timeout=T))
            wait_for(lambda n=i + 1: sum(s.server.open for s in stubs.values()) == n, what=f"request {i} arrived")
    finally:
        for s in stubs.values():
            s.release()
    picks = ["".join(m.text for m in c) for c in calls]
    assert sorted(picks.count(r) for r in stubs) == [3, 3, 3]
    assert {rid: len(s.calls) - before[rid] for rid, s in stubs.items()} == {"R1": 3, "R2": 3, "R3": 3}


@pytest.mark.parametrize("front", FRONTS)
def test_longer_match_wins_in_every_insertion_order(front, stubs, stubs_of, router):
    for k, order in enumerate((["R1", "R2"], ["R2", "R1"])):
        tokens = prompt(2000 + 10 * FRONTS.index(front) + k, 6 * B + 1)
        for rid in order:
            stubs[rid].store(tokens, blocks=2 if rid == "R1" else 5)  # R1: 32 tokens, R2: 80
        indexed(router, stubs["R2"], tokens, 5)
        indexed(router, stubs["R1"], tokens, 2)
        picked, call = generate(stubs_of[front], tokens)
        assert picked == "R2"
        assert dict(call.trailing_metadata())["x-kvroute-predicted-cached-tokens"] == "80"


@pytest.mark.parametrize("front", FRONTS)
@pytest.mark.parametrize(("r1_queued", "winner"), [(555, "R1"), (557, "R2 or R3")])
def test_ninety_percent_cached_request_on_both_sides_of_its_queue_line(front, r1_queued, winner, stubs, stubs_of,
                                                                       router):
    # R1 holds 18 of the 20 blocks of p2 (288 of 320 tokens) and runs 10 sequences:
    # R1 = q + 2 x 32 + 20 ms, an idle one = 2 x 320 = 640 ms: R1 wins while q < 556 tokens.
    p2 = prompt(3000 + 10 * FRONTS.index(front) + r1_queued, 20 * B)
    stubs["R1"].store(p2, blocks=18)
    indexed(router, stubs["R1"], p2, 18)
    set_load(router, stubs["R1"], running=10, queued_prefill_tokens=r1_queued)
    picked, call = generate(stubs_of[front], p2)
    if winner == "R1":
        assert picked == "R1"
        assert dict(call.trailing_metadata())["x-kvroute-predicted-cached-tokens"] == "288"
    else:
        assert picked in ("R2", "R3")


@pytest.mark.parametrize("front", FRONTS)
def test_tenants_with_different_cache_salt_never_share_blocks(front, stubs, stubs_of, router):
    tokens = prompt(4000 + FRONTS.index(front), 6 * B + 1)
    stubs["R1"].store(tokens, cache_salt="tenant-a")
    indexed(router, stubs["R1"], tokens, 6, salt="tenant-a")
    picked_a, call_a = generate(stubs_of[front], tokens, "tenant-a")
    _, call_b = generate(stubs_of[front], tokens, "tenant-b")
    _, call_plain = generate(stubs_of[front], tokens)
    assert picked_a == "R1"
    assert dict(call_a.trailing_metadata())["x-kvroute-predicted-cached-tokens"] == "96"
    assert dict(call_b.trailing_metadata())["x-kvroute-predicted-cached-tokens"] == "0"
    assert dict(call_plain.trailing_metadata())["x-kvroute-predicted-cached-tokens"] == "0"


# -- the subset hint, on the picker's own ext_proc stream --------------------------------------------
def _pick_messages(ids, subset, *, attributes: bool = False):
    """One call's messages: the headers, then the body; with ``attributes`` the body alone carrying
    :path and content-type as request attributes (kvroute_tools.envoy's bootstrap)."""
    body = gen_pb.GenerateRequest(token_ids=gen_pb.TokenIds(ids=ids)).SerializeToString()
    frame = b"\x00" + len(body).to_bytes(4, "big") + body
    headers = ext_pb.HttpHeaders(headers=core_pb.HeaderMap(headers=[
        core_pb.HeaderValue(key=":path", raw_value=b"/kvroute.v1.GenerationService/GenerateStream"),
        core_pb.HeaderValue(key="content-type", raw_value=b"application/grpc"),
    ]))
    md = core_pb.Metadata()
    if subset is not None:
        lv = md.filter_metadata["envoy.lb.subset_hint"].fields["x-gateway-destination-endpoint-subset"].list_value
        lv.SetInParent()  # an empty list is a set hint too
        for a in subset:
            lv.values.add().string_value = a
    body_msg = ext_pb.ProcessingRequest(request_body=ext_pb.HttpBody(body=frame, end_of_stream=True), metadata_context=md)
    if attributes:
        fields = body_msg.attributes["envoy.filters.http.ext_proc"].fields
        fields["request.path"].string_value = "/kvroute.v1.GenerationService/GenerateStream"
        fields["request.headers['content-type']"].string_value = "application/grpc"
    else:
        yield ext_pb.ProcessingRequest(request_headers=headers, metadata_context=md)
    yield body_msg


def pick(router, ids, subset, *, attributes: bool = False) -> ext_pb.ProcessingResponse:
    """The picker's answer to the body of one call with the subset hint ``subset`` (None: no hint)."""
    with grpc.insecure_channel(router.picker_target) as ch:
        answers = list(ext_grpc.ExternalProcessorStub(ch).Process(_pick_messages(ids, subset, attributes=attributes),
                                                                  timeout=T))
    if attributes:
        assert len(answers) == 1
        return answers[0]
    assert answers[0].WhichOneof("response") == "request_headers"
    return answers[1]


@pytest.mark.parametrize("attributes", [False, True], ids=["headers", "attributes"])
def test_subset_hint_keeps_the_pick_inside_it(attributes, stubs, router):
    tokens = prompt(5000, 6 * B + 1)
    stubs["R1"].store(tokens)
    indexed(router, stubs["R1"], tokens, 6)
    unhinted = pick(router, tokens, None, attributes=attributes)
    assert unhinted.dynamic_metadata.fields["envoy.lb"].struct_value.fields[
        "x-gateway-destination-endpoint"].string_value == stubs["R1"].target
    hinted = pick(router, tokens, [stubs["R3"].target, "10.9.9.9:1"], attributes=attributes)  # R1, the best, is outside
    header = hinted.request_body.response.header_mutation.set_headers[0].header
    assert (header.key, header.raw_value.decode()) == ("x-gateway-destination-endpoint", stubs["R3"].target)
    assert hinted.dynamic_metadata.fields["envoy.lb"].struct_value.fields[
        "x-gateway-destination-endpoint"].string_value == stubs["R3"].target
    wait_for(lambda: not router.server.load.local(), what="the picks' load released with their streams")


@pytest.mark.parametrize("subset", [[], ["10.9.9.9:1"]], ids=["empty", "ineligible"])
def test_empty_or_ineligible_subset_is_503(subset, router):
    answer = pick(router, prompt(5001, 40), subset)
    assert answer.WhichOneof("response") == "immediate_response"
    assert answer.immediate_response.status.code == 503
    assert answer.immediate_response.grpc_status.status == grpc.StatusCode.UNAVAILABLE.value[0]
    assert not router.server.load.local()


def test_every_waiting_queue_full_is_429_and_one_free_queue_takes_the_call(stubs, stubs_of, router):
    for s in stubs.values():
        set_load(router, s, waiting=4)  # each at its max_waiting (4)
    answer = pick(router, prompt(5002, 40), None)
    assert answer.WhichOneof("response") == "immediate_response"
    assert answer.immediate_response.status.code == 429
    assert "R1 4/4" in answer.immediate_response.details
    with pytest.raises(grpc.RpcError) as err:
        generate(stubs_of["envoy"], prompt(5003, 40))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.details().startswith("every replica's waiting queue is full")
    set_load(router, stubs["R2"], waiting=3)
    assert generate(stubs_of["envoy"], prompt(5004, 40))[0] == "R2"


def test_a_queue_full_since_its_heartbeat_is_retried_on_the_next_best_by_the_proxy(stubs, stubs_of, router):
    # R1 holds the whole prompt and is idle in its heartbeat (the cheapest by far), but its queue
    # filled since: it answers RESOURCE_EXHAUSTED. The proxy tries the next best (R2 and R3 tie:
    # idle, nothing cached) before any token, and the client gets its answer, not R1's 429.
    tokens = prompt(5100, 10 * B)
    stubs["R1"].store(tokens)
    indexed(router, stubs["R1"], tokens, 10)
    stubs["R1"].refuse((grpc.StatusCode.RESOURCE_EXHAUSTED, "waiting queue is full (4 requests, max_waiting=4)"))
    try:
        before = len(stubs["R1"].calls)
        picked, _ = generate(stubs_of["proxy"], tokens)
        assert picked in ("R2", "R3") and len(stubs["R1"].calls) == before + 1
    finally:
        stubs["R1"].refuse(None)


def test_fallbacks_follow_the_pick_cheapest_first(stubs, router):
    from router.picker.servicer import EndpointPicker

    tokens = prompt(5005, 6 * B + 1)
    stubs["R2"].store(tokens, blocks=6)
    stubs["R3"].store(tokens, blocks=3)
    indexed(router, stubs["R2"], tokens, 6)
    indexed(router, stubs["R3"], tokens, 3)
    picker = EndpointPicker(router.server.routing, fallbacks=2)

    # The servicer alone, as its server's pool thread drives it: the messages in, the answers out.
    answers = list(picker.Process(_pick_messages(tokens, None), None))
    value = answers[1].dynamic_metadata.fields["envoy.lb"].struct_value.fields["x-gateway-destination-endpoint"]
    assert value.string_value == ",".join(stubs[r].target for r in ("R2", "R3", "R1"))
    wait_for(lambda: not router.server.load.local(), what="the pick's load released with the stream")


def test_a_picks_pending_prefill_lasts_until_its_replicas_heartbeat_covers_it(stubs, stubs_of, router):
    for s in stubs.values():
        s.hold()  # the call stays in flight: no byte comes back
    try:
        call = stubs_of["envoy"].GenerateStream(gen_pb.GenerateRequest(
            token_ids=gen_pb.TokenIds(ids=prompt(6000, 160)), sampling=gen_pb.SamplingParams(max_tokens=1)), timeout=T)
        wait_for(lambda: sum(s.server.open for s in stubs.values()) == 1, what="the call at its replica")
        assert sorted(router.server.load.local().values()) == [(1, 160)]  # counted at the pick
        # Later picks settle earlier ones whose replica has heartbeated (every 0.1 s) 0.25 s after them.
        wait_for(lambda: pick(router, prompt(6001, 40), None) and sorted(router.server.load.local().values()) == [(1, 0)],
                 what="the held call's prefill released, the call still in flight")
    finally:
        for s in stubs.values():
            s.release()
    assert "".join(m.text for m in call) in stubs
    wait_for(lambda: not router.server.load.local(), what="released at the end of the stream")


def test_the_bootstrap_names_what_the_picker_reads():
    from kvroute_tools import envoy
    from router.picker import protocol

    assert (envoy.DESTINATION_HEADER, envoy.LB_NAMESPACE) == (protocol.DESTINATION_HEADER, protocol.LB_NAMESPACE)
    assert (protocol.PATH_ATTRIBUTE, protocol.CONTENT_TYPE_ATTRIBUTE, *protocol.TRACE_ATTRIBUTES) == envoy.REQUEST_ATTRIBUTES


def test_an_openai_call_through_envoy_needs_a_vllm_replica(envoy, router):
    # The gateway forwards the JSON unchanged to the heartbeat's address: kvroute replicas serve gRPC
    # there, so with none but them the call is refused (503, the OpenAI error body), not mis-sent.
    import json
    import urllib.error
    import urllib.request

    body = json.dumps({"prompt": "hello there", "max_tokens": 1}).encode()
    request = urllib.request.Request(f"http://{envoy.target}/v1/completions", data=body,
                                     headers={"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=T)
    assert err.value.code == 503
    message = json.loads(err.value.read())["error"]["message"]
    assert "needs a vllm replica, the routable ones are kvroute" in message
    assert not router.server.load.local()


def _over_the_buffer() -> list[int]:
    """Token ids whose request body is over Envoy's 1 MiB buffer (ids 300..499 take 2 bytes each)."""
    ids = [300 + i % 200 for i in range(600_000)]
    assert len(gen_pb.TokenIds(ids=ids).SerializeToString()) > 1 << 20
    return ids


@pytest.mark.parametrize("front", FRONTS)
def test_a_body_over_envoys_buffer_is_refused_with_a_status_and_message_that_say_why(front, stubs, stubs_of, router):
    before = {rid: len(s.calls) for rid, s in stubs.items()}
    request = gen_pb.GenerateRequest(token_ids=gen_pb.TokenIds(ids=_over_the_buffer()),
                                     sampling=gen_pb.SamplingParams(max_tokens=1))
    with pytest.raises(grpc.RpcError) as err:
        list(stubs_of[front].GenerateStream(request, timeout=T))
    if front == "proxy":  # no buffer in the way: the prompt is longer than the model holds
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.details().startswith("prompt: "), err.value.details()
    else:
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "request body is over Envoy's limit of 1048576 bytes" in err.value.details(), err.value.details()
    assert {rid: len(s.calls) for rid, s in stubs.items()} == before
    assert not router.server.load.local()


def test_an_openai_body_over_envoys_buffer_is_413_with_an_openai_error_body(envoy, router):
    import json
    import urllib.error
    import urllib.request

    body = json.dumps({"model": "m", "prompt": _over_the_buffer(), "max_tokens": 1}).encode()
    request = urllib.request.Request(f"http://{envoy.target}/v1/completions", data=body,
                                     headers={"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=T)
    assert err.value.code == 413
    assert err.value.headers["content-type"] == "application/json"
    error = json.loads(err.value.read())["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "request_too_large"
    assert "request body is over Envoy's limit of 1048576 bytes" in error["message"], error
    assert not router.server.load.local()
