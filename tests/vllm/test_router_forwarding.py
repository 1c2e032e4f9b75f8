"""kvroute's router in front of a real vLLM server (router/vllm_upstream.py, DESIGN.md §3.4): the
gRPC GenerationService and the OpenAI HTTP front both served by vLLM through the router, with
vLLM's own answers as the reference, its errors passed through with their status, and a cancelled
call aborted at vLLM; and a real Envoy whose endpoint picker is the router sending OpenAI calls to
vLLM's HTTP address.

The vLLM replica's heartbeat is written here the way ``kvroute bridge`` writes it (engine
``vllm``, address = vLLM's HTTP host:port, the router's hash identity)."""

from __future__ import annotations

import grpc
import openai
import pytest

from kvroute.engine_info import EngineInfo
from kvroute.hashing import BlockHasher
from kvroute.heartbeat import ENGINE_VLLM
from kvroute.redis_layout import RedisLayout
from kvroute.v1 import generation_pb2 as gen_pb
from kvroute.v1 import generation_pb2_grpc as gen_grpc
from kvroute_tools.envoy import EnvoyFront
from replica.publisher.redis_publisher import RedisEventPublisher
from router.server import BackgroundRouter
from router.settings import RouterSettings
from tests.support import wait_for
from tests.vllm.conftest import BLOCK_SIZE

T = 120.0


@pytest.fixture(scope="module")
def redis_server():
    from kvroute_tools.redis_server import RedisServer

    with RedisServer() as s:
        yield s


@pytest.fixture(scope="module")
def heartbeat(redis_server, vllm_server):
    algorithm, digest, block_size = BlockHasher(block_size=BLOCK_SIZE).identity
    info = EngineInfo(model=vllm_server.model, vocab_size=529, max_model_len=2048, block_size=block_size,
                      num_blocks=1000, hash_algorithm=algorithm, hash_seed_digest=digest)
    publisher = RedisEventPublisher(redis_server.url, RedisLayout(), "vllm-0", info, vllm_server.address,
                                    heartbeat_interval=0.2, heartbeat_ttl=5.0, engine=ENGINE_VLLM)
    publisher.start()
    yield publisher
    publisher.close()


@pytest.fixture(scope="module")
def router(redis_server, default_model_dir, heartbeat):
    settings = RouterSettings(host="127.0.0.1", port=0, http_port=0, redis_url=redis_server.url,
                              model=str(default_model_dir), block_size=BLOCK_SIZE, heartbeat_poll_interval=0.1,
                              picker_port=0)
    with BackgroundRouter(settings) as r:
        wait_for(lambda: [i.replica_id for i in r.server.registry.routable()] == ["vllm-0"], what="vLLM routable")
        yield r


def greedy(n: int) -> gen_pb.SamplingParams:
    return gen_pb.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_a_grpc_call_through_the_router_is_vllms_own_answer(router, vllm_server):
    ids = list(range(40, 110))
    direct = vllm_server.post("/v1/completions", {"model": vllm_server.model, "prompt": ids, "max_tokens": 8,
                                                  "temperature": 0.0, "ignore_eos": True, "return_token_ids": True})
    with grpc.insecure_channel(router.target) as ch:
        deltas = list(gen_grpc.GenerationServiceStub(ch).GenerateStream(
            gen_pb.GenerateRequest(token_ids=gen_pb.TokenIds(ids=ids), sampling=greedy(8)), timeout=T))
    assert [t for d in deltas for t in d.token_ids] == direct["choices"][0]["token_ids"]
    assert "".join(d.text for d in deltas) == direct["choices"][0]["text"]
    final = deltas[-1]
    assert final.finish_reason == gen_pb.FINISH_REASON_LENGTH
    assert final.routing.replica_id == "vllm-0" and final.routing.replica_address == vllm_server.address
    # The direct call stored the prompt's 2 full blocks: vLLM reports them cached.
    assert (final.usage.prompt_tokens, final.usage.completion_tokens, final.usage.cached_tokens) == (70, 8, 64)


def test_the_openai_http_front_through_the_router_answers_as_vllm_does(router, vllm_server):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say something."}]
    direct = openai.OpenAI(base_url=vllm_server.url + "/v1", api_key="x").chat.completions.create(
        model=vllm_server.model, messages=messages, max_tokens=6, temperature=0.0, extra_body={"ignore_eos": True})
    via = openai.OpenAI(base_url=f"http://127.0.0.1:{router.server.http_port}/v1", api_key="x")
    out = via.chat.completions.create(model=vllm_server.model, messages=messages, max_tokens=6, temperature=0.0,
                                      extra_body={"ignore_eos": True})
    assert out.choices[0].message.content == direct.choices[0].message.content
    assert out.usage.prompt_tokens == direct.usage.prompt_tokens  # the router's chat template is vLLM's
    streamed = via.completions.create(model=vllm_server.model, prompt="Once upon", max_tokens=5, temperature=0.0,
                                      stream=True, extra_body={"ignore_eos": True})
    text = "".join(c.choices[0].text for c in streamed if c.choices)
    plain = openai.OpenAI(base_url=vllm_server.url + "/v1", api_key="x").completions.create(
        model=vllm_server.model, prompt="Once upon", max_tokens=5, temperature=0.0, extra_body={"ignore_eos": True})
    assert text == plain.choices[0].text


def test_vllms_refusal_reaches_the_client_with_its_status(router, vllm_server):
    # 20 prompt tokens + 4,000 new ones cannot fit vLLM's 2,048-token context: refused, not cut.
    with grpc.insecure_channel(router.target) as ch, pytest.raises(grpc.RpcError) as err:
        gen_grpc.GenerationServiceStub(ch).Generate(gen_pb.GenerateRequest(
            token_ids=gen_pb.TokenIds(ids=list(range(40, 60))),
            sampling=gen_pb.SamplingParams(max_tokens=4000)), timeout=T)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert "max_tokens" in err.value.details() or "2048" in err.value.details()


def test_a_cancelled_call_is_aborted_at_vllm(router, vllm_server):
    with grpc.insecure_channel(router.target) as ch:
        call = gen_grpc.GenerationServiceStub(ch).GenerateStream(
            gen_pb.GenerateRequest(token_ids=gen_pb.TokenIds(ids=list(range(40, 100))), sampling=greedy(1500)),
            timeout=T)
        next(call)  # the first token: the request runs at vLLM
        # vLLM refreshes its gauges from the engine's stats a step or more after the token streams.
        wait_for(lambda: vllm_server.metric("vllm:num_requests_running") == 1, timeout=30.0,
                 what="vLLM counts the request running")
        call.cancel()
    wait_for(lambda: vllm_server.metric("vllm:num_requests_running") == 0, timeout=30.0,
             what="vLLM aborted the cancelled request")
    wait_for(lambda: not router.server.load.local(), what="the router released the call's load")


@pytest.fixture(scope="module")
def envoy(router, tmp_path_factory):
    with EnvoyFront(router.target, picker_target=router.picker_target, folder=tmp_path_factory.mktemp("envoy")) as e:
        yield e


def test_openai_calls_through_envoy_and_the_picker_are_served_by_vllm(envoy, router, vllm_server):
    direct = openai.OpenAI(base_url=vllm_server.url + "/v1", api_key="x")
    via = openai.OpenAI(base_url=f"http://{envoy.target}/v1", api_key="x")
    prompt = "The picker sends this to vLLM's own HTTP port. " * 3
    plain = direct.completions.create(model=vllm_server.model, prompt=prompt, max_tokens=5, temperature=0.0,
                                      extra_body={"ignore_eos": True})
    streamed = via.completions.create(model=vllm_server.model, prompt=prompt, max_tokens=5, temperature=0.0,
                                      stream=True, stream_options={"include_usage": True},
                                      extra_body={"ignore_eos": True})
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
    # The direct call stored the prompt's full blocks; vLLM reused them for the call through Envoy.
    usage = chunks[-1].usage
    assert usage.prompt_tokens == plain.usage.prompt_tokens
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens // BLOCK_SIZE * BLOCK_SIZE
    messages = [{"role": "user", "content": "Say something."}]
    chat = via.chat.completions.create(model=vllm_server.model, messages=messages, max_tokens=4, temperature=0.0,
                                       extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == direct.chat.completions.create(
        model=vllm_server.model, messages=messages, max_tokens=4, temperature=0.0,
        extra_body={"ignore_eos": True}).choices[0].message.content
    wait_for(lambda: not router.server.load.local(), what="the picks' load released with their streams")


def test_a_grpc_call_through_envoy_finds_no_kvroute_replica(envoy, vllm_server):
    # The gateway forwards gRPC bytes unchanged: a vLLM server's address does not take them.
    with grpc.insecure_channel(envoy.target) as ch, pytest.raises(grpc.RpcError) as err:
        gen_grpc.GenerationServiceStub(ch).Generate(gen_pb.GenerateRequest(
            token_ids=gen_pb.TokenIds(ids=list(range(40, 60))), sampling=greedy(2)), timeout=T)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "needs a kvroute replica, the routable ones are vllm" in err.value.details()
