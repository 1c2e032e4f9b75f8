"""The router refuses what it can check itself before it routes (the replica's own
kvroute.sampling.validate_request against the model limits the routable replicas' heartbeats
report, router/model_limits.py), and withdraws a pick's speculative entries when the replica
refuses the request (router/proxy.py, DESIGN.md §5). Real redis-server, real router, a real replica
(and heartbeats from addresses where nothing listens: a refused request never reaches one, and the
router learns their limits with no call to them)."""

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
    anything it forwards fails UNAVAILABLE, and no GetModelInfo to it can ever be answered. Its
    heartbeat says vocab_size 500, max_model_len 1024 (tests.support_redis.engine_info)."""
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
        (gen_pb.SamplingParams(repetition_penalty=0.0), prompt(1, 40),
         "repetition_penalty: must be greater than 0 (1 = off), got 0.0"),
        (gen_pb.SamplingParams(presence_penalty=2.5), prompt(1, 40), "presence_penalty: must be in [-2, 2] (0 = off), got 2.5"),
        (gen_pb.SamplingParams(frequency_penalty=-3.0), prompt(1, 40),
         "frequency_penalty: must be in [-2, 2] (0 = off), got -3.0"),
        (gen_pb.SamplingParams(min_tokens=20, max_tokens=10), prompt(2, 40), "min_tokens: must be at most"),
        # The ghost's heartbeat limits, below the model folder's (8192 tokens, 529 ids):
        (GREEDY, prompt(3, 1024), "prompt: is 1024 tokens, but the model holds at most 1024 tokens"),
        (GREEDY, [*prompt(6, 40), 520], "prompt.token_ids: token id 520 at index 40 is out of vocabulary [0, 500)"),
        (gen_pb.SamplingParams(stop_token_ids=[510]), prompt(5, 8), "unknown stop token 510 at index 0"),
    ],
    ids=["top_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "min_tokens", "too_long", "token_id",
         "stop_token_id"],
)
def test_a_request_the_router_can_check_is_refused_before_it_reaches_a_replica(ghost_router, sampling, ids, message):
    with grpc.insecure_channel(ghost_router.target) as channel:
        with pytest.raises(grpc.RpcError) as err:
            gen_grpc.GenerationServiceStub(channel).Generate(
                gen_pb.GenerateRequest(token_ids=gen_pb.TokenIds(ids=ids), sampling=sampling), timeout=T)
        known = [t for t in ids if t < 500]  # Score refuses an unknown id too
        score = router_grpc.RouterServiceStub(channel).Score(router_pb.ScoreRequest(token_ids=gen_pb.TokenIds(ids=known)),
                                                             timeout=T)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # not UNAVAILABLE: never forwarded
    assert message in err.value.details()
    assert score.replicas[0].speculative_matched_blocks == 0  # nothing credited, nothing routed


def test_the_limits_come_from_the_heartbeat_not_the_model_folder(ghost_router):
    routing = ghost_router.server.routing
    assert (routing.tokenizer.vocab_size, routing.tokenizer.max_model_len) == (529, 8192)  # the folder's
    assert routing.model_limits() == (500, 1024)  # the ghost's heartbeat: nothing listens there to ask


def test_a_prompt_the_replica_refuses_leaves_no_speculative_entries_for_its_prefix(redis_server, default_model_dir):
    settings = ReplicaSettings(host="127.0.0.1", port=0, model=str(default_model_dir), num_blocks=64,
                               torch_threads=1, replica_id="short", engine_process=False, max_model_len=256,
                               redis_url=redis_server.url, namespace="short", heartbeat_interval=0.2)
    # A second routable replica says it holds 2048 tokens (nothing listens at its address): the
    # router lets a 1000-token prompt through, for the pick to refuse.
    roomy = FakeReplica(redis_server, RedisLayout("short"), "roomy", port=free_port(),
                        identity={"max_model_len": 2048})
    with BackgroundReplica(settings), routed(redis_server, default_model_dir, "short") as router:
        wait_for(lambda: len(router.server.registry.routable()) == 2, what="both replicas routable")
        assert router.server.routing.model_limits()[1] == 2048
        huge = prompt(4, 1000)
        with grpc.insecure_channel(router.target) as channel:
            gen = gen_grpc.GenerationServiceStub(channel)
            with pytest.raises(grpc.RpcError) as err:
                gen.Generate(gen_pb.GenerateRequest(token_ids=gen_pb.TokenIds(ids=huge), sampling=GREEDY), timeout=T)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "at most 256 tokens" in err.value.details()  # the replica's refusal
            resp = gen.Generate(gen_pb.GenerateRequest(token_ids=gen_pb.TokenIds(ids=huge[:200]), sampling=GREEDY), timeout=T)
            # Once the roomy one's heartbeat expires, no routable replica holds 1000 tokens: the
            # router refuses by itself.
            roomy.close()
            wait_for(lambda: router.server.routing.model_limits()[1] == 256, what="the roomy replica expired")
            with pytest.raises(grpc.RpcError) as again:
                gen.Generate(gen_pb.GenerateRequest(token_ids=gen_pb.TokenIds(ids=huge), sampling=GREEDY), timeout=T)
            assert again.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "x-kvroute-replica" not in dict(again.value.trailing_metadata() or ())
    assert resp.routing.predicted_cached_tokens == 0
    assert resp.usage.cached_tokens == 0
