"""The router refuses what it can check itself before it routes (the replica's own
kvroute.sampling.validate_request against the replicas' model limits), and withdraws a pick's
speculative entries when the replica refuses the request (router/proxy.py, DESIGN.md §5). Real
redis-server, real router, a real replica (and a heartbeating address where nothing listens, to
show that a refused request never reaches one)."""

from __future__ import annotations

import random

import grpc
import pytest

from kvroute.redis_layout import RedisLayout
from kvroute.v1 import generation_pb2 as gen_pb
from kvroute.v1 import generation_pb2_grpc as gen_grpc
from kvroute.v1 import router_pb2 as router_pb
from kvroute.v1 import router_pb2_grpc as router_grpc
from kvroute_tools.redis_server import free_port
from replica.server import BackgroundReplica
from replica.settings import ReplicaSettings
from router.server import BackgroundRouter
from router.settings import RouterSettings
from tests.support import wait_for
from tests.support_redis import FakeReplica

T = 30.0
GREEDY = gen_pb.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 500) for _ in range(n)]


def routed(redis_server, model_dir, namespace: str):
    settings = RouterSettings(host="127.0.0.1", port=0, redis_url=redis_server.url, model=str(model_dir),
                              namespace=namespace, heartbeat_poll_interval=0.1, seed=0)
    return BackgroundRouter(settings)


@pytest.fixture(scope="module")
def ghost_router(redis_server, default_model_dir):
    """A router whose only routable replica heartbeats from an address where nothing listens:
    anything it forwards fails UNAVAILABLE."""
    ghost = FakeReplica(redis_server, RedisLayout("ghost"), "ghost", port=free_port())
    try:
        with routed(redis_server, default_model_dir, "ghost") as r:
            wait_for(lambda: r.server.registry.routable(), what="the ghost replica routable")
            yield r
    finally:
        ghost.close()


@pytest.mark.parametrize(
    ("sampling", "ids", "message"),
    [
        (gen_pb.SamplingParams(top_p=2.0), prompt(1, 40), "top_p: must be in (0, 1], got 2.0"),
        (gen_pb.SamplingParams(min_tokens=20, max_tokens=10), prompt(2, 40), "min_tokens: must be at most"),
        (GREEDY, prompt(3, 8192), "prompt: is 8192 tokens, but the model holds at most 8192 tokens"),
    ],
    ids=["top_p", "min_tokens", "too_long"],
)
def test_a_request_the_router_can_check_is_refused_before_it_reaches_a_replica(ghost_router, sampling, ids, message):
    with grpc.insecure_channel(ghost_router.target) as channel:
        with pytest.raises(grpc.RpcError) as err:
            gen_grpc.GenerationServiceStub(channel).Generate(
                gen_pb.GenerateRequest(token_ids=gen_pb.TokenIds(ids=ids), sampling=sampling), timeout=T)
        score = router_grpc.RouterServiceStub(channel).Score(router_pb.ScoreRequest(token_ids=gen_pb.TokenIds(ids=ids)), timeout=T)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # not UNAVAILABLE: never forwarded
    assert message in err.value.details()
    assert score.replicas[0].speculative_matched_blocks == 0  # nothing credited, nothing routed


def test_a_prompt_the_replica_refuses_leaves_no_speculative_entries_for_its_prefix(redis_server, default_model_dir):
    settings = ReplicaSettings(host="127.0.0.1", port=0, model=str(default_model_dir), num_blocks=64,
                               torch_threads=1, replica_id="short", engine_process=False, max_model_len=256,
                               redis_url=redis_server.url, namespace="short", heartbeat_interval=0.2)
    with BackgroundReplica(settings), routed(redis_server, default_model_dir, "short") as router:
        wait_for(lambda: router.server.registry.routable(), what="the replica routable")
        huge = prompt(4, 1000)  # fits the model folder's 8192 (the router's limits before any answer)
        with grpc.insecure_channel(router.target) as channel:
            gen = gen_grpc.GenerationServiceStub(channel)
            with pytest.raises(grpc.RpcError) as err:
                gen.Generate(gen_pb.GenerateRequest(token_ids=gen_pb.TokenIds(ids=huge), sampling=GREEDY), timeout=T)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "at most 256 tokens" in err.value.details()  # the replica's refusal
            resp = gen.Generate(gen_pb.GenerateRequest(token_ids=gen_pb.TokenIds(ids=huge[:200]), sampling=GREEDY), timeout=T)
            # The router has learned the replica's limit from its GetModelInfo: it refuses by itself now.
            wait_for(lambda: router.server.proxy.limits.current[1] == 256, what="the replica's max_model_len learned")
            with pytest.raises(grpc.RpcError) as again:
                gen.Generate(gen_pb.GenerateRequest(token_ids=gen_pb.TokenIds(ids=huge), sampling=GREEDY), timeout=T)
            assert again.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "x-kvroute-replica" not in dict(again.value.trailing_metadata() or ())
    assert resp.routing.predicted_cached_tokens == 0
    assert resp.usage.cached_tokens == 0
