"""A router routes only to replicas serving its model (router/registry.py): two stub replicas in one
namespace, one serving the router's model and one another model that holds the prompt's whole prefix
and is idle. Without the model check the idle replica with the cache would win every pick; with it,
every call through the proxy and through Envoy + the endpoint picker lands on the replica serving
the model the request names."""

from __future__ import annotations

import random

import grpc
import pytest

from kvroute.hashing import BlockHasher
from kvroute.heartbeat import EngineLoad
from kvroute.prompt import DEFAULT_MODEL_DIRNAME
from kvroute.v1 import generation_pb2 as gen_pb
from kvroute.v1 import generation_pb2_grpc as gen_grpc
from kvroute_tools.envoy import EnvoyFront
from router.server import BackgroundRouter
from router.settings import RouterSettings
from tests.integration.stub_replicas import IDLE, StubReplica
from tests.support import wait_for

OTHER = "another-model"


@pytest.fixture(scope="module")
def cluster(redis_server, default_model_dir, tmp_path_factory):
    hasher = BlockHasher(block_size=16)
    ours = StubReplica("ours", redis_server.url, hasher)
    theirs = StubReplica("theirs", redis_server.url, hasher, model=OTHER)
    settings = RouterSettings(host="127.0.0.1", port=0, redis_url=redis_server.url, model=str(default_model_dir),
                              heartbeat_poll_interval=0.05, speculative_ttl=0.0, picker_port=0)
    try:
        with BackgroundRouter(settings) as router:
            wait_for(lambda: {i.replica_id for i in router.server.registry.all()} == {"ours", "theirs"},
                     what="both stubs heartbeating")
            with EnvoyFront(router.target, picker_target=router.picker_target,
                            folder=tmp_path_factory.mktemp("envoy")) as envoy:
                yield router, envoy, ours, theirs
    finally:
        ours.close()
        theirs.close()


def test_a_replica_serving_another_model_gets_no_call_through_either_front(cluster):
    router, envoy, ours, theirs = cluster
    info = router.server.registry.get("theirs")
    assert not info.routable
    assert info.reason == f"model {OTHER!r} != router's {DEFAULT_MODEL_DIRNAME!r}"
    assert [i.replica_id for i in router.server.registry.routable()] == ["ours"]

    ids = [random.Random(3).randrange(10, 500) for _ in range(160)]
    theirs.store(ids)  # the whole prefix, on the idle replica of the other model
    ours.set_load(EngineLoad(**{**IDLE.__dict__, "running": 8, "queued_prefill_tokens": 4000}))
    for target in (router.target, envoy.target):
        with grpc.insecure_channel(target) as channel:
            gen = gen_grpc.GenerationServiceStub(channel)
            for _ in range(3):
                req = gen_pb.GenerateRequest(token_ids=gen_pb.TokenIds(ids=ids), sampling=gen_pb.SamplingParams(max_tokens=1))
                list(gen.GenerateStream(req, timeout=20.0))
    assert (len(ours.calls), len(theirs.calls)) == (6, 0)


def test_a_grpc_request_naming_another_model_is_not_found_through_either_front(cluster):
    router, envoy, ours, _ = cluster
    before = len(ours.calls)
    for target in (router.target, envoy.target):
        with grpc.insecure_channel(target) as channel:
            gen = gen_grpc.GenerationServiceStub(channel)
            req = gen_pb.GenerateRequest(text="hello", model=OTHER, sampling=gen_pb.SamplingParams(max_tokens=1))
            with pytest.raises(grpc.RpcError) as err:
                list(gen.GenerateStream(req, timeout=20.0))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND, target
            assert err.value.details() == (f"model: {OTHER!r} is not served here"
                                           f" (this server serves {DEFAULT_MODEL_DIRNAME!r})")
            named = gen_pb.GenerateRequest(text="hello", model=DEFAULT_MODEL_DIRNAME,
                                           sampling=gen_pb.SamplingParams(max_tokens=1))
            list(gen.GenerateStream(named, timeout=20.0))
    assert len(ours.calls) == before + 2


def test_an_openai_call_through_envoy_naming_another_model_is_404(cluster):
    import json
    import urllib.error
    import urllib.request

    _, envoy, _, _ = cluster
    body = json.dumps({"model": OTHER, "prompt": "hello there", "max_tokens": 1}).encode()
    request = urllib.request.Request(f"http://{envoy.target}/v1/completions", data=body,
                                     headers={"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=20.0)
    assert err.value.code == 404
    error = json.loads(err.value.read())["error"]
    assert error["param"] == "model" and OTHER in error["message"]
