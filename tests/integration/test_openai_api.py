"""The OpenAI-compatible HTTP API of a replica and of the router, driven with the official
``openai`` client over loopback (kvroute/openai_http.py, replica/http_api.py, router/http_api.py).

One real redis-server, one replica (BackgroundReplica: generated default model, 128 KV blocks,
engine on a thread, HTTP on a free port) and one router (BackgroundRouter, HTTP on a free port)
per module; most tests run against both fronts (``side``) and compare with the same side's gRPC
API. Covered: completions (string, ids, batch) and chat, streaming and not, greedy output equal to
gRPC's, usage and cached tokens, every bad input of the gRPC table as a 400 naming the field, a
100k-token prompt refused before any block is allocated, a disconnect mid-stream freeing the
replica's blocks, 429 on a full queue, 404 for an unknown model, the router's replica header and
503 when nothing is routable, chat ids equal between HTTP and gRPC for a corpus of conversations,
/metrics (and the replica's vLLM metric names), ``kvroute up``'s banner and curl example, and
``kvroute bench``'s replay over the HTTP API against the gRPC one.

One module on purpose, hence its length (over 400 lines): every test runs against the one
module-scoped cluster, whose start costs more than most tests; split, it would start once per file.
"""

from __future__ import annotations

import asyncio
import json
import random

import grpc
import httpx2
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvroute.openai_api import chat_request
from kvroute.prompt import PromptTokenizer
from kvroute.telemetry import setup_telemetry
from kvroute.v1 import generation_pb2 as gen_pb
from kvroute.v1 import generation_pb2_grpc as gen_grpc
from kvroute.v1 import replica_pb2 as rep_pb
from kvroute.v1 import replica_pb2_grpc as rep_grpc
from replica.server import BackgroundReplica
from replica.settings import ReplicaSettings
from router.server import BackgroundRouter
from router.settings import RouterSettings
from tests.support import replica_idle, wait_for

B = 16
T = 30.0
ADMIN_TOKEN = "test-admin-token"  # the router's, for kvroute bench's SetPolicy
MODEL = "kvroute-tiny-llama"
SIDES = ("replica", "router")


# -- the cluster ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def replica(redis_server, default_model_dir):
    telemetry = setup_telemetry("kvroute-replica-openai-test", 0, otlp=False)  # a Prometheus registry
    with BackgroundReplica(ReplicaSettings(
        replica_id="rep-http", host="127.0.0.1", port=0, http_port=0, model=str(default_model_dir),
        redis_url=redis_server.url, num_blocks=128, torch_threads=1, heartbeat_interval=0.2, heartbeat_ttl=5.0, max_num_seqs=4,
        max_waiting=6, engine_process=False,
    ), telemetry=telemetry) as r:
        yield r
    telemetry.shutdown()


def router_settings(redis_server, model_dir, **kw) -> RouterSettings:
    base = dict(host="127.0.0.1", port=0, http_port=0, redis_url=redis_server.url, model=str(model_dir), seed=0,
                heartbeat_poll_interval=0.1, load_sync_interval=0.1)
    return RouterSettings(**{**base, **kw})


@pytest.fixture(scope="module")
def router(redis_server, default_model_dir, replica):
    telemetry = setup_telemetry("kvroute-router-openai-test", 0, otlp=False)  # a Prometheus registry
    settings = router_settings(redis_server, default_model_dir, admin_token=ADMIN_TOKEN)  # kvroute bench
    with BackgroundRouter(settings, telemetry=telemetry) as r:
        wait_for(lambda: [i.replica_id for i in r.server.registry.routable()] == ["rep-http"], what="replica routable")
        yield r
    telemetry.shutdown()


@pytest.fixture(scope="module")
def servers(replica, router):
    return {"replica": replica, "router": router}


def http_base(server) -> str:
    return f"http://127.0.0.1:{server.server.http_port}/v1"


def health(server) -> httpx2.Response:
    return httpx2.get(f"http://127.0.0.1:{server.server.http_port}/health", timeout=T)


@pytest.fixture(scope="module", params=SIDES)
def side(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def client(servers, side) -> openai.OpenAI:
    return openai.OpenAI(base_url=http_base(servers[side]), api_key="unused", max_retries=0, timeout=T)


@pytest.fixture(scope="module")
def gen(servers, side) -> gen_grpc.GenerationServiceStub:
    return gen_grpc.GenerationServiceStub(grpc.insecure_channel(servers[side].target))


@pytest.fixture(scope="module")
def rep(replica) -> rep_grpc.ReplicaServiceStub:
    return rep_grpc.ReplicaServiceStub(grpc.insecure_channel(replica.target))


@pytest.fixture(scope="module")
def model_info(rep) -> gen_pb.ModelInfo:
    return rep.GetModelInfo(gen_pb.GetModelInfoRequest(), timeout=T)


def greedy(n: int) -> gen_pb.SamplingParams:
    return gen_pb.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


GREEDY = {"max_tokens": 12, "temperature": 0.0, "extra_body": {"ignore_eos": True}}


def random_ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 500) for _ in range(n)]


# -- completions and chat: the gRPC API's output -----------------------------------------------------
def test_completion_greedy_output_and_usage_equal_the_grpc_api(client, gen):
    text = "The harbour town woke before the sun."
    out = client.completions.create(model=MODEL, prompt=text, **GREEDY)
    ref = gen.Generate(gen_pb.GenerateRequest(text=text, sampling=greedy(12)), timeout=T)
    (choice,) = out.choices
    assert choice.text == ref.text and choice.finish_reason == "length"
    assert out.object == "text_completion" and out.model == MODEL and out.id.startswith("cmpl-")
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (ref.usage.prompt_tokens, 12)
    assert out.usage.total_tokens == ref.usage.prompt_tokens + 12


def test_the_penalties_are_applied_as_over_grpc_not_ignored(client, gen):
    ids = random_ids(2, 5) * 8  # a repeating prompt: the repetition penalty must change its continuation
    body = {"max_tokens": 16, "temperature": 0.0}
    plain = client.completions.create(model=MODEL, prompt=ids, **body, extra_body={"ignore_eos": True})
    penalised = client.completions.create(model=MODEL, prompt=ids, **body, frequency_penalty=1.5,
                                          extra_body={"ignore_eos": True, "repetition_penalty": 1.8})
    ref = gen.Generate(gen_pb.GenerateRequest(token_ids=gen_pb.TokenIds(ids=ids), sampling=gen_pb.SamplingParams(
        max_tokens=16, temperature=0.0, ignore_eos=True, repetition_penalty=1.8, frequency_penalty=1.5)), timeout=T)
    assert penalised.choices[0].text == ref.text != plain.choices[0].text
    assert penalised.usage.completion_tokens == 16


def test_streaming_completion_is_the_unary_one_in_deltas_with_a_usage_chunk(client):
    ids = random_ids(1, 20)
    whole = client.completions.create(model=MODEL, prompt=ids, **GREEDY)
    chunks = list(client.completions.create(model=MODEL, prompt=ids, stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    *deltas, usage = chunks
    assert "".join(c.choices[0].text for c in deltas) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in deltas][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in deltas[:-1]) and all(c.usage is None for c in deltas)
    assert usage.choices == [] and usage.usage.completion_tokens == 12 and usage.usage.prompt_tokens == 20
    assert len({c.id for c in chunks}) == 1


def test_batch_prompt_gives_one_choice_per_prompt_as_each_alone(client):
    prompts = ["A lantern swung above the pier.", random_ids(2, 9)]
    batch = client.completions.create(model=MODEL, prompt=prompts, **GREEDY)
    alone = [client.completions.create(model=MODEL, prompt=p, **GREEDY).choices[0].text for p in prompts]
    assert [c.index for c in batch.choices] == [0, 1]
    assert [c.text for c in batch.choices] == alone
    assert batch.usage.completion_tokens == 24
    streamed = {0: "", 1: ""}
    for chunk in client.completions.create(model=MODEL, prompt=prompts, stream=True, **GREEDY):
        streamed[chunk.choices[0].index] += chunk.choices[0].text
    assert list(streamed.values()) == alone


def test_chat_greedy_output_equals_the_grpc_chat_streaming_and_not(client, gen):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "How is the harbour?"}]
    ref = gen.Generate(gen_pb.GenerateRequest(chat=gen_pb.ChatMessages(
        messages=[gen_pb.ChatMessage(**m) for m in messages]), sampling=greedy(12)), timeout=T)
    out = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.text
    assert out.usage.prompt_tokens == ref.usage.prompt_tokens
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_max_completion_tokens_bounds_a_chat_answer(client):
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                         max_completion_tokens=3, temperature=0.0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3 and out.choices[0].finish_reason == "length"


def test_without_max_tokens_a_chat_answer_may_fill_the_context_and_a_completion_stops_at_16(client, model_info):
    # vLLM's defaults: a chat request gets the room the prompt leaves; /v1/completions keeps 16 (OpenAI's).
    prompt = random_ids(5, model_info.max_model_len - 40)
    out = client.completions.create(model=MODEL, prompt=prompt, temperature=0.0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 16 and out.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                          temperature=0.0, extra_body={"ignore_eos": True})
    room = model_info.max_model_len - chat.usage.prompt_tokens
    assert room > 16 and chat.usage.completion_tokens == room and chat.choices[0].finish_reason == "length"


def test_a_prompt_that_leaves_less_room_than_max_tokens_is_cut_to_the_room_as_vllm_does(client, model_info):
    prompt = random_ids(6, model_info.max_model_len - 20)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=100, temperature=0.0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 20 and out.choices[0].finish_reason == "length"


def test_repeated_long_prompt_reports_cached_tokens_on_the_second_call(client, side):
    ids = random_ids(100 + SIDES.index(side), 6 * B + 5)  # 6 full blocks + 5 tokens, new to the cache
    first = client.completions.create(model=MODEL, prompt=ids, **GREEDY)
    second = client.completions.create(model=MODEL, prompt=ids, **GREEDY)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 6 * B
    assert second.choices[0].text == first.choices[0].text


def test_stop_seed_and_cache_salt_reach_the_engine(client, side):
    text = "The harbour town woke before the sun."
    whole = client.completions.create(model=MODEL, prompt=text, **GREEDY).choices[0].text
    stop = whole[4:6]
    cut = client.completions.create(model=MODEL, prompt=text, stop=[stop], **GREEDY).choices[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop and cut.text == whole[:whole.index(stop)]
    seeded = [client.completions.create(model=MODEL, prompt=text, max_tokens=12, temperature=1.0, seed=7).choices[0].text
              for _ in range(2)]
    assert seeded[0] == seeded[1]
    ids = random_ids(200 + SIDES.index(side), 4 * B + 1)
    for salt, cached in (("tenant-a", 0), ("tenant-a", 4 * B), ("tenant-b", 0)):
        out = client.completions.create(model=MODEL, prompt=ids, extra_body={"cache_salt": salt}, max_tokens=2)
        assert out.usage.prompt_tokens_details.cached_tokens == cached, salt


def test_models_and_health(client, servers, side, model_info):
    (card,) = client.models.list().data
    assert card.id == MODEL and card.owned_by == "kvroute"
    # The replica's own limit; on the router, the one its heartbeat says (128 blocks: 2032 tokens).
    assert card.to_dict()["max_model_len"] == model_info.max_model_len == 127 * B
    resp = health(servers[side])
    assert resp.status_code == 200 and resp.json() == {"status": "ok"}


def metrics_text(server) -> str:
    resp = httpx2.get(f"http://127.0.0.1:{server.server.http_port}/metrics", timeout=T)
    assert resp.status_code == 200
    return resp.text


def test_metrics_serve_the_process_registry(servers):
    def types(text: str) -> set[str]:
        return {line for line in text.splitlines() if line.startswith("# TYPE ")}

    for server, ours in ((servers["router"], "kvroute_router"), (servers["replica"], "kvroute_replica")):
        text = metrics_text(server)
        assert types(text) == types(server.server.telemetry.prometheus_text()) and ours in text


def vllm_samples(text: str) -> dict[str, float]:
    """``name{finished_reason}`` -> value of every vllm: sample (labels model_name and engine checked)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("vllm:"):
                assert sample.labels["model_name"] == MODEL and sample.labels["engine"] == "0"
                reason = sample.labels.get("finished_reason")
                out[sample.name + (f"{{{reason}}}" if reason else "")] = sample.value
    return out


def test_replica_publishes_vllm_metric_names_with_vllm_semantics(replica):
    before = vllm_samples(metrics_text(replica))
    assert {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
            "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:request_success_total{stop}",
            "vllm:request_success_total{length}", "vllm:request_success_total{abort}", "vllm:prompt_tokens_total",
            "vllm:generation_tokens_total", "vllm:num_preemptions_total"} <= set(before)
    client = openai.OpenAI(base_url=http_base(replica), api_key="unused", max_retries=0, timeout=T)
    ids = random_ids(300, 2 * B + 3)
    for _ in range(2):
        client.completions.create(model=MODEL, prompt=ids, **GREEDY)
    after = wait_for(lambda: (a := vllm_samples(metrics_text(replica)))["vllm:prefix_cache_hits_total"]
                     > before["vllm:prefix_cache_hits_total"] and a, what="the second call's prefix hit sampled")

    def delta(name: str) -> float:
        return after[name] - before[name]

    assert delta("vllm:request_success_total{length}") == 2 and delta("vllm:request_success_total{stop}") == 0
    assert delta("vllm:prompt_tokens_total") == 2 * len(ids) and delta("vllm:generation_tokens_total") == 24
    assert delta("vllm:prefix_cache_hits_total") == 2 * B and delta("vllm:prefix_cache_queries_total") >= 2 * B
    assert after["vllm:num_requests_running"] == after["vllm:num_requests_waiting"] == 0
    assert after["vllm:kv_cache_usage_perc"] == 0.0


# -- refusals: OpenAI's error shape, naming the field ------------------------------------------------
def _bad_bodies(max_model_len: int, vocab: int) -> list[tuple[str, str, dict, str]]:
    """The gRPC bad-input table (tests/replica/test_service.py) as HTTP bodies, plus the fields only
    HTTP has: (label, "completions" | "chat", body, the field named)."""
    ok = [1, 2, 3]
    return [
        ("empty text", "completions", {"prompt": ""}, "prompt"),
        ("empty token ids", "completions", {"prompt": []}, "prompt"),
        ("no prompt", "completions", {}, "prompt"),
        ("empty chat", "chat", {"messages": []}, "messages"),
        ("bad chat role", "chat", {"messages": [{"role": "robot", "content": "hi"}]}, "messages"),
        ("prompt = max_model_len", "completions", {"prompt": [1] * max_model_len}, "prompt"),
        ("prompt > max_model_len", "completions", {"prompt": "harbour " * max_model_len}, "prompt"),
        ("huge prompt", "completions", {"prompt": [1] * 100_000}, "prompt"),
        ("token id >= vocab", "completions", {"prompt": [1, vocab, 2]}, "prompt"),
        ("max_tokens 0", "completions", {"prompt": ok, "max_tokens": 0}, "max_tokens"),
        ("temperature < 0", "completions", {"prompt": ok, "temperature": -0.5}, "temperature"),
        ("top_p 0", "completions", {"prompt": ok, "top_p": 0.0}, "top_p"),
        ("top_p 1.5", "completions", {"prompt": ok, "top_p": 1.5}, "top_p"),
        ("top_k -2", "completions", {"prompt": ok, "top_k": -2}, "top_k"),
        ("min_p 2", "completions", {"prompt": ok, "min_p": 2.0}, "min_p"),
        ("repetition_penalty 0", "completions", {"prompt": ok, "repetition_penalty": 0}, "repetition_penalty"),
        ("presence_penalty 2.5", "chat", {"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 2.5},
         "presence_penalty"),
        ("frequency_penalty -3", "completions", {"prompt": ok, "frequency_penalty": -3}, "frequency_penalty"),
        ("penalty a string", "completions", {"prompt": ok, "repetition_penalty": "high"}, "repetition_penalty"),
        ("beam search", "completions", {"prompt": ok, "use_beam_search": True}, "use_beam_search"),
        ("guided_json", "chat", {"messages": [{"role": "user", "content": "hi"}], "guided_json": {}}, "guided_json"),
        ("include_stop_str_in_output", "completions", {"prompt": ok, "include_stop_str_in_output": True},
         "include_stop_str_in_output"),
        ("unknown stop token", "completions", {"prompt": ok, "stop_token_ids": [vocab + 7]}, "stop_token_ids"),
        ("empty stop string", "completions", {"prompt": ok, "stop": [""]}, "stop"),
        ("n 2", "completions", {"prompt": ok, "n": 2}, "n"),
        ("logprobs", "completions", {"prompt": ok, "logprobs": 1}, "logprobs"),
        ("chat logprobs", "chat", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True}, "logprobs"),
        ("negative max_tokens", "completions", {"prompt": ok, "max_tokens": -1}, "max_tokens"),
        ("max_tokens a string", "completions", {"prompt": ok, "max_tokens": "ten"}, "max_tokens"),
        ("max_tokens > max_model_len", "completions", {"prompt": ok, "max_tokens": max_model_len + 1}, "max_tokens"),
        ("chat max_tokens > max_model_len", "chat",
         {"messages": [{"role": "user", "content": "hi"}], "max_tokens": max_model_len + 1}, "max_tokens"),
        ("non-text content", "chat", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "messages[0].content"),
    ]


def test_each_bad_input_is_a_400_in_openai_error_shape_naming_the_field(client, rep, model_info):
    before = rep.GetLoad(rep_pb.GetLoadRequest(), timeout=T)
    for label, endpoint, body, field in _bad_bodies(model_info.max_model_len, model_info.vocab_size):
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as err:
                client.post(f"/{endpoint}" if endpoint == "completions" else "/chat/completions",
                            body={"model": MODEL, **body, "stream": stream}, cast_to=object)
            assert err.value.status_code == 400, label
            error = err.value.body
            assert error["type"] == "invalid_request_error" and error["param"] == field, (label, error)
            assert error["message"].startswith(f"{field}: "), (label, error)
    after = rep.GetLoad(rep_pb.GetLoadRequest(), timeout=T)
    assert (after.running, after.waiting, after.kv_usage) == (before.running, before.waiting, 0.0) == (0, 0, 0.0)


def test_100k_token_prompt_is_refused_before_any_block_is_allocated(client, rep):
    before = rep.GetLoad(rep_pb.GetLoadRequest(), timeout=T)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=[1] * 100_000, max_tokens=1)
    assert err.value.body["param"] == "prompt"
    after = rep.GetLoad(rep_pb.GetLoadRequest(), timeout=T)
    # Never scheduled: no prefix-cache lookup was made, no block left the free pool.
    assert after.prefix_cache_queries == before.prefix_cache_queries
    assert after.free_blocks == before.free_blocks and after.kv_usage == 0.0


def test_unknown_model_is_404_naming_the_model(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=1)
    assert err.value.body["param"] == "model" and "no-such-model" in err.value.body["message"]


def test_unknown_fields_are_ignored(client):
    out = client.completions.create(model=MODEL, prompt="hi", max_tokens=12, temperature=0.0,
                                    extra_body={"ignore_eos": True, "no_such_field": [1, 2]})
    assert out.usage.completion_tokens == 12


# -- cancellation and admission --------------------------------------------------------------------------
def test_disconnect_mid_stream_aborts_the_request_and_frees_its_blocks(client, rep, replica):
    stream = client.completions.create(model=MODEL, prompt="cancel me " * 20, stream=True, max_tokens=2000,
                                       temperature=0.0, extra_body={"ignore_eos": True})
    for _, _chunk in zip(range(5), stream, strict=False):
        pass
    assert rep.GetLoad(rep_pb.GetLoadRequest(), timeout=T).running == 1
    stream.close()
    wait_for(lambda: replica_idle(rep), what="replica idle after the disconnect")
    assert replica.server.frontend.num_in_flight == 0
    eng = replica.server.engine.engine
    assert eng.usage == 0.0 and not eng.has_unfinished_requests()


def test_a_full_waiting_queue_is_429(servers, side, rep):
    async def flood() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=http_base(servers[side]), api_key="unused", max_retries=0, timeout=T)

        async def one(i: int) -> str:
            try:
                await aclient.completions.create(model=MODEL, prompt=[1 + i, 2, 3, 4], max_tokens=16,
                                                 temperature=0.0, extra_body={"ignore_eos": True})
            except openai.RateLimitError as e:
                assert e.body["type"] == "rate_limit_error"
                return "429"
            return "200"

        try:
            return await asyncio.gather(*(one(i) for i in range(40)))
        finally:
            await aclient.close()

    outcomes = asyncio.run(flood())
    assert set(outcomes) == {"200", "429"}, outcomes
    wait_for(lambda: replica_idle(rep), what="replica idle after the flood")


# -- the router's own parts -------------------------------------------------------------------------------
def test_router_responses_name_the_serving_replica_in_a_header(servers):
    client = openai.OpenAI(base_url=http_base(servers["router"]), api_key="unused", max_retries=0, timeout=T)
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="hi", **GREEDY)
    assert raw.headers["x-kvroute-replica"] == "rep-http"
    assert int(raw.headers["x-kvroute-predicted-cached-tokens"]) >= 0
    with client.completions.with_streaming_response.create(model=MODEL, prompt="hi", stream=True, **GREEDY) as resp:
        assert resp.headers["x-kvroute-replica"] == "rep-http"
        lines = [line for line in resp.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: {") for line in lines[:-1])


def test_router_with_nothing_routable_answers_503(redis_server, default_model_dir, replica):
    # Another block size: the replica is discovered but not hash-compatible, so never routable.
    with BackgroundRouter(router_settings(redis_server, default_model_dir, block_size=32)) as r:
        client = openai.OpenAI(base_url=http_base(r), api_key="unused", max_retries=0, timeout=T)
        with pytest.raises(openai.InternalServerError) as err:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert err.value.status_code == 503 and err.value.body["type"] == "service_unavailable"
        resp = health(r)
        assert resp.status_code == 503 and resp.json()["reason"] == "no routable replica"
        resp = httpx2.get(f"http://127.0.0.1:{r.server.http_port}/metrics", timeout=T)  # no telemetry here
        assert resp.status_code == 404 and resp.json()["error"]["param"] == "metrics"


# -- chat: the ids HTTP computes are gRPC's ---------------------------------------------------------------
CHAT_CORPUS = [
    [{"role": "user", "content": "Hello"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where are the boats?"}],
    [{"role": "user", "content": "One"}, {"role": "assistant", "content": "Two"}, {"role": "user", "content": "Three?"}],
    [{"role": "user", "content": "<s> looks like BOS </s> and [INST] too"}],
    [{"role": "user", "content": [{"type": "text", "text": "parts "}, {"type": "text", "text": "joined"}]}],
    [{"role": "user", "content": "ünïcödé ✓ 港"}, {"role": "assistant", "content": ""},
     {"role": "user", "content": "again"}],
]


@pytest.mark.parametrize("messages", CHAT_CORPUS, ids=range(len(CHAT_CORPUS)))
def test_chat_ids_are_equal_between_http_and_grpc(messages, client, gen, default_model_dir):
    tok = PromptTokenizer.from_folder(default_model_dir)
    http_ids = tok.token_ids(chat_request({"messages": messages}))
    grpc_request = gen_pb.GenerateRequest(chat=gen_pb.ChatMessages(messages=[
        gen_pb.ChatMessage(role=m["role"], content=m["content"] if isinstance(m["content"], str)
                           else "".join(p["text"] for p in m["content"])) for m in messages]))
    assert http_ids == tok.token_ids(grpc_request)
    # What the serving side computes: the same count, and the same greedy answer as those ids given as ids.
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0.0,
                                         extra_body={"ignore_eos": True})
    assert out.usage.prompt_tokens == len(http_ids)
    ref = gen.Generate(gen_pb.GenerateRequest(token_ids=gen_pb.TokenIds(ids=http_ids), sampling=greedy(4)), timeout=T)
    assert out.choices[0].message.content == ref.text


# -- kvroute up ------------------------------------------------------------------------------------------
def test_kvroute_up_banner_prints_the_http_endpoint_and_a_curl_example_that_works(servers, default_model_dir):
    import shlex
    import subprocess

    from kvroute_tools.banner import banner_text as up_banner
    from kvroute_tools.cluster import ClusterConfig, LocalCluster
    from kvroute_tools.up import substitute

    router = servers["router"]
    cluster = LocalCluster(ClusterConfig(replicas=1))
    try:
        cluster.routers = [type("Router", (), {"target": router.target, "pid": 1, "name": "router"})()]  # type: ignore[list-item]
        cluster.replicas, cluster.model_dir = [], str(default_model_dir)
        cluster.router_http_url = http_base(router)
        cluster.router_http_urls = [cluster.router_http_url]
        banner = up_banner(cluster)
        assert f"  openai      {http_base(router)} " in banner
        (curl,) = [line.strip() for line in banner.splitlines() if line.strip().startswith("curl ")]
        done = subprocess.run(shlex.split(curl), capture_output=True, text=True, timeout=T, check=True)
        assert json.loads(done.stdout)["usage"]["completion_tokens"] == 16
        assert substitute(["replay", "--base-url", "{http_url}"], cluster) == ["replay", "--base-url", http_base(router)]
    finally:
        cluster.routers = []
        cluster.stop()


# -- kvroute bench --api openai --------------------------------------------------------------------------
def test_bench_over_the_openai_api_matches_the_grpc_replay(servers):
    from kvroute_tools.bench.config import BenchConfig
    from kvroute_tools.bench.run import run_bench

    router = servers["router"]
    runs = {}
    for api in ("grpc", "openai"):  # one after the other, each with its own cache salt
        cfg = BenchConfig(target=router.target, requests=40, max_output_tokens=4, concurrency=1,
                          policies=("kvroute",), progress=False, api=api, admin_token=ADMIN_TOKEN,
                          http_url=http_base(router) if api == "openai" else "")
        runs[api] = asyncio.run(run_bench(cfg, log=lambda s: None)).policies[0]
    grpc_run, http_run = runs["grpc"], runs["openai"]
    assert grpc_run.errors == http_run.errors == 0
    assert grpc_run.hit_rate_source == http_run.hit_rate_source == "replica counters"
    assert grpc_run.hit_rate > 0 and abs(http_run.hit_rate - grpc_run.hit_rate) <= 0.005
    assert {r.replica_id for r in http_run.results} == {"rep-http"}
    assert [r.prompt_tokens for r in http_run.results] == [r.prompt_tokens for r in grpc_run.results]
