"""The replica's gRPC services over real gRPC on loopback (DESIGN.md §3.3).

One replica per module (generated default model, 256 KV blocks, max_num_seqs 4, max_waiting 50) on
its own event-loop thread; the tests dial it like a router would.
"""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from kvroute.v1 import generation_pb2 as gen_pb
from kvroute.v1 import replica_pb2 as rep_pb
from replica.engine.params import SamplingParams
from replica.server import BackgroundReplica
from replica.settings import ReplicaSettings
from replica.wire import GENERATION_SERVICE, REPLICA_SERVICE, sampling_params_from_proto
from tests.support import (
    abort_mid_stream,
    assert_duplicate_request_id_refused,
    concurrent_stream_outcomes,
    deltas_before_deadline,
    started_stream,
    wait_for,
)
from tests.support import replica_idle as idle

BLOCK = 16
GREEDY_LONG = gen_pb.SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def settings(tmp_path_factory) -> ReplicaSettings:
    return ReplicaSettings(
        host="127.0.0.1", port=0, model_cache_dir=str(tmp_path_factory.mktemp("models")), num_blocks=256,
        torch_threads=1, max_num_seqs=4, max_waiting=50, replica_id="test-replica",
        engine_process=False,  # the tests read the LLMEngine (server.engine.engine) in this process
    )


@pytest.fixture(scope="module")
def replica(settings):
    with BackgroundReplica(settings) as r:
        yield r


@pytest.fixture(scope="module")
def grpc_target(replica) -> str:
    return replica.target  # conftest's channel / gen / rep connect here


@pytest.fixture(scope="module")
def model_info(gen):
    return gen.GetModelInfo(gen_pb.GetModelInfoRequest())


# -- happy path -------------------------------------------------------------------------------------
def test_stream_yields_the_engine_greedy_tokens_and_final_usage(replica, settings, gen):
    from replica.engine.engine import LLMEngine
    from replica.server import resolve_model_dir

    prompt = "The harbour town woke before the sun. Fishing boats slid out past the breakwater."
    engine = LLMEngine(resolve_model_dir(settings)[0], settings.engine_config())
    (direct,) = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0))

    deltas = list(gen.GenerateStream(gen_pb.GenerateRequest(
        text=prompt, sampling=gen_pb.SamplingParams(max_tokens=24, temperature=0.0)
    )))
    ids = [t for d in deltas for t in d.token_ids]
    assert ids == direct.output_token_ids
    assert all(d.finish_reason == gen_pb.FINISH_REASON_UNSPECIFIED for d in deltas[:-1])
    assert not any(d.HasField("usage") for d in deltas[:-1])
    last = deltas[-1]
    assert last.finish_reason == gen_pb.FINISH_REASON_LENGTH
    assert last.usage.prompt_tokens == direct.num_prompt_tokens
    assert last.usage.completion_tokens == 24
    assert len({d.request_id for d in deltas}) == 1 and deltas[0].request_id


def test_repeated_prompt_reports_cached_tokens_of_its_full_blocks(rep):
    ids = [(7 * i + 3) % 500 for i in range(3 * BLOCK + 5)]  # 3 full blocks + 5 tokens
    req = rep_pb.ReplicaGenerateRequest(token_ids=ids, sampling=gen_pb.SamplingParams(max_tokens=4, temperature=0.0))
    first = rep.Generate(req)
    second = rep.Generate(req)
    assert first.usage.cached_tokens == 0
    assert second.usage.cached_tokens == 3 * BLOCK
    assert second.usage.prompt_tokens == 3 * BLOCK + 5
    assert list(second.token_ids) == list(first.token_ids)


def test_unary_generate_is_the_concatenation_of_the_stream(gen):
    req = gen_pb.GenerateRequest(
        request_id="concat-1", token_ids=gen_pb.TokenIds(ids=[1, 2, 3, 4, 5, 6, 7, 8]),
        sampling=gen_pb.SamplingParams(max_tokens=12, temperature=0.0),
    )
    deltas = list(gen.GenerateStream(req))
    whole = gen.Generate(req)
    assert list(whole.token_ids) == [t for d in deltas for t in d.token_ids]
    assert whole.text == "".join(d.text for d in deltas)
    assert whole.request_id == "concat-1"
    assert whole.finish_reason == deltas[-1].finish_reason == gen_pb.FINISH_REASON_LENGTH
    assert whole.usage.completion_tokens == 12 == len(whole.token_ids)


def test_stop_token_ends_the_stream_and_is_reported_as_matched_stop(gen):
    greedy = gen_pb.SamplingParams(max_tokens=8, temperature=0.0)
    ids = list(gen.Generate(gen_pb.GenerateRequest(text="Stop here", sampling=greedy)).token_ids)
    stop = ids[3]
    sampling = gen_pb.SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[stop])
    resp = gen.Generate(gen_pb.GenerateRequest(text="Stop here", sampling=sampling))
    assert resp.finish_reason == gen_pb.FINISH_REASON_STOP
    assert resp.WhichOneof("matched_stop") == "stop_token_id" and resp.stop_token_id == stop
    assert list(resp.token_ids) == ids[: ids.index(stop) + 1]


def test_chat_prompt_is_rendered_with_a_single_bos(replica, gen, rep):
    tok = replica.server.engine.engine.tokenizer
    messages = [gen_pb.ChatMessage(role="user", content="How is the harbour today?")]
    resp = gen.Generate(gen_pb.GenerateRequest(
        chat=gen_pb.ChatMessages(messages=messages), sampling=gen_pb.SamplingParams(max_tokens=3, temperature=0.0)
    ))
    text = tok.apply_chat_template([{"role": "user", "content": "How is the harbour today?"}])
    expected = tok.encode(text, add_special_tokens=False)
    assert expected.count(tok.bos_token_id) == 1
    assert resp.usage.prompt_tokens == len(expected)
    same = rep.Generate(rep_pb.ReplicaGenerateRequest(
        token_ids=expected, sampling=gen_pb.SamplingParams(max_tokens=3, temperature=0.0)
    ))
    assert list(same.token_ids) == list(resp.token_ids)


def test_model_info_and_load(gen, rep, replica):
    info = gen.GetModelInfo(gen_pb.GetModelInfoRequest())
    eng = replica.server.engine.engine
    assert info == rep.GetModelInfo(gen_pb.GetModelInfoRequest())
    assert (info.model, info.vocab_size, info.block_size) == ("kvroute-tiny-llama", eng.vocab_size, 16)
    assert info.max_model_len == eng.max_model_len
    assert (info.hash_algorithm, info.hash_seed_digest) == ("sha256_cbor", eng.hasher.seed_digest)
    assert list(info.eos_token_ids)[0] == eng.eos_token_id
    load = rep.GetLoad(rep_pb.GetLoadRequest())
    assert load.replica_id == "test-replica" and load.num_blocks == 256
    assert 0 < load.free_blocks <= 255


def test_health_reports_readiness_and_every_service_serving(channel):
    stub = health_pb2_grpc.HealthStub(channel)
    for name in ("", "liveness", "readiness", GENERATION_SERVICE, REPLICA_SERVICE):
        resp = stub.Check(health_pb2.HealthCheckRequest(service=name))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING, name


def test_reflection_lists_the_services(channel):
    db = ProtoReflectionDescriptorDatabase(channel)
    names = set(db.get_services())
    assert {GENERATION_SERVICE, REPLICA_SERVICE, "grpc.health.v1.Health"} <= names
    assert db.FindFileContainingSymbol(REPLICA_SERVICE).name == "kvroute/v1/replica.proto"


def test_unset_sampling_fields_keep_the_engine_defaults():
    assert sampling_params_from_proto(gen_pb.SamplingParams()) == SamplingParams()
    assert sampling_params_from_proto(None) == SamplingParams()
    got = sampling_params_from_proto(gen_pb.SamplingParams(max_tokens=5, top_k=0, stop=["x"], seed=0))
    assert got == SamplingParams(max_tokens=5, top_k=0, stop=("x",), seed=0)


# -- bad input: INVALID_ARGUMENT naming the field, before the engine ------------------------------------
def _bad_requests(max_model_len: int, vocab: int) -> list[tuple[str, gen_pb.GenerateRequest, str]]:
    ok = gen_pb.TokenIds(ids=[1, 2, 3])
    sp = gen_pb.SamplingParams
    return [
        ("empty text", gen_pb.GenerateRequest(text=""), "prompt"),
        ("empty token ids", gen_pb.GenerateRequest(token_ids=gen_pb.TokenIds()), "prompt"),
        ("no prompt", gen_pb.GenerateRequest(), "prompt"),
        ("empty chat", gen_pb.GenerateRequest(chat=gen_pb.ChatMessages()), "prompt.chat"),
        ("bad chat role", gen_pb.GenerateRequest(chat=gen_pb.ChatMessages(messages=[gen_pb.ChatMessage(
            role="robot", content="hi")])), "prompt.chat"),
        ("prompt = max_model_len", gen_pb.GenerateRequest(token_ids=gen_pb.TokenIds(ids=[1] * max_model_len)), "prompt"),
        ("prompt > max_model_len", gen_pb.GenerateRequest(text="harbour " * max_model_len), "prompt"),
        ("huge prompt", gen_pb.GenerateRequest(token_ids=gen_pb.TokenIds(ids=[1] * 100_000)), "prompt"),
        ("token id >= vocab", gen_pb.GenerateRequest(token_ids=gen_pb.TokenIds(ids=[1, vocab, 2])), "prompt.token_ids"),
        ("max_tokens 0", gen_pb.GenerateRequest(token_ids=ok, sampling=sp(max_tokens=0)), "max_tokens"),
        ("max_tokens > max_model_len", gen_pb.GenerateRequest(token_ids=ok, sampling=sp(max_tokens=100_000)),
         "max_tokens"),
        ("temperature < 0", gen_pb.GenerateRequest(token_ids=ok, sampling=sp(temperature=-0.5)), "temperature"),
        ("top_p 0", gen_pb.GenerateRequest(token_ids=ok, sampling=sp(top_p=0.0)), "top_p"),
        ("top_p 1.5", gen_pb.GenerateRequest(token_ids=ok, sampling=sp(top_p=1.5)), "top_p"),
        ("top_k -2", gen_pb.GenerateRequest(token_ids=ok, sampling=sp(top_k=-2)), "top_k"),
        ("min_p 2", gen_pb.GenerateRequest(token_ids=ok, sampling=sp(min_p=2.0)), "min_p"),
        ("repetition_penalty 0", gen_pb.GenerateRequest(token_ids=ok, sampling=sp(repetition_penalty=0.0)),
         "repetition_penalty"),
        ("presence_penalty -2.5", gen_pb.GenerateRequest(token_ids=ok, sampling=sp(presence_penalty=-2.5)),
         "presence_penalty"),
        ("frequency_penalty 2.5", gen_pb.GenerateRequest(token_ids=ok, sampling=sp(frequency_penalty=2.5)),
         "frequency_penalty"),
        ("unknown stop token", gen_pb.GenerateRequest(token_ids=ok, sampling=sp(stop_token_ids=[vocab + 7])), "stop_token_ids"),
        ("empty stop string", gen_pb.GenerateRequest(token_ids=ok, sampling=sp(stop=[""])), "stop"),
    ]


def test_each_bad_input_is_invalid_argument_naming_the_field(gen, rep, model_info):
    before = rep.GetLoad(rep_pb.GetLoadRequest())
    for label, request, field in _bad_requests(model_info.max_model_len, model_info.vocab_size):
        for rpc in (gen.Generate, lambda r: list(gen.GenerateStream(r))):
            with pytest.raises(grpc.RpcError) as err:
                rpc(request)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, label
            assert err.value.details().startswith(f"{field}: "), (label, err.value.details())
    after = rep.GetLoad(rep_pb.GetLoadRequest())
    assert (after.running, after.waiting) == (before.running, before.waiting) == (0, 0)


def test_replica_service_rejects_bad_token_ids_naming_the_field(rep, model_info):
    bad = rep_pb.ReplicaGenerateRequest(token_ids=[0, model_info.vocab_size])
    with pytest.raises(grpc.RpcError) as err:
        rep.Generate(bad)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("prompt.token_ids: ")
    with pytest.raises(grpc.RpcError) as err:
        list(rep.GenerateStream(rep_pb.ReplicaGenerateRequest(token_ids=[])))
    assert err.value.details().startswith("prompt: ")


def test_request_snapshot_without_redis_is_failed_precondition_naming_redis_url(rep):
    with pytest.raises(grpc.RpcError) as err:
        rep.RequestSnapshot(rep_pb.RequestSnapshotRequest())
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.value.details().startswith("redis_url: ")


def test_duplicate_in_flight_request_id_is_invalid_argument(gen, rep):
    assert_duplicate_request_id_refused(gen, rep, "dup-1", GREEDY_LONG)


# -- cancellation, deadlines, Abort: every block comes back ---------------------------------------------
def test_client_cancel_mid_stream_frees_every_block(gen, rep, replica):
    stream = started_stream(gen, gen_pb.GenerateRequest(text="cancel me " * 20, sampling=GREEDY_LONG), 5)
    assert rep.GetLoad(rep_pb.GetLoadRequest()).running == 1
    stream.cancel()
    wait_for(lambda: idle(rep))
    eng = replica.server.engine.engine
    assert eng.usage == 0.0 and eng.num_running == 0 and not eng.has_unfinished_requests()
    assert replica.server.frontend.num_in_flight == 0


def test_deadline_expiry_mid_stream_is_deadline_exceeded_and_frees_every_block(gen, rep, replica):
    stream = gen.GenerateStream(gen_pb.GenerateRequest(text="too slow " * 20, sampling=GREEDY_LONG), timeout=0.8)
    received = deltas_before_deadline(stream)
    assert 0 < received < 3000
    wait_for(lambda: idle(rep))
    eng = replica.server.engine.engine
    assert eng.usage == 0.0 and eng.num_running == 0 and not eng.has_unfinished_requests()


def test_abort_ends_the_stream_with_finish_reason_abort_and_is_idempotent(gen, rep):
    rest = abort_mid_stream(gen, rep, "abort-me", GREEDY_LONG)
    assert rest[-1].usage.completion_tokens >= 1
    assert not rep.Abort(rep_pb.AbortRequest(request_id="never-existed")).found
    wait_for(lambda: idle(rep))


# -- admission control ---------------------------------------------------------------------------------
def test_200_concurrent_streams_over_max_waiting_get_resource_exhausted_and_nothing_else(replica, rep):
    counts = concurrent_stream_outcomes(replica.target, 200)
    assert set(counts) == {"OK", "RESOURCE_EXHAUSTED"}, counts
    assert counts["OK"] >= 50, counts
    wait_for(lambda: idle(rep))
