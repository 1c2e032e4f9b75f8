"""The replica with its engine in its own process (``engine_process``, the default; DESIGN.md §3.3).

One replica publishing to a throwaway Redis serves the behaviour tests over real gRPC; the tests
that kill the engine process get a replica of their own. ``ProcessLLMEngine`` is also driven
directly for what the service does not show (``call``, startup errors, no orphan process).
"""

from __future__ import annotations

import asyncio
import functools
import os
import pickle
import signal

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvroute.events import AllBlocksCleared, BlockStored, decode_batch
from kvroute.hashing import BlockHasher, to_event_int
from kvroute.model_folder import ModelLoadError
from kvroute.redis_layout import RedisLayout
from kvroute.v1 import events_pb2
from kvroute.v1 import generation_pb2 as gen_pb
from kvroute.v1 import generation_pb2_grpc as gen_grpc
from kvroute.v1 import replica_pb2 as rep_pb
from kvroute_tools.redis_server import RedisServer
from replica.engine.async_engine import EngineDeadError
from replica.engine.core_client import ProcessLLMEngine
from replica.engine.params import SamplingParams
from replica.server import BackgroundReplica, build_process_engine, resolve_model_dir
from replica.settings import ReplicaSettings
from tests import support
from tests.support import (
    abort_mid_stream,
    assert_duplicate_request_id_refused,
    concurrent_stream_outcomes,
    deltas_before_deadline,
    pid_alive,
    started_stream,
)
from tests.support import replica_idle as idle

BLOCK = 16
NAMESPACE = "proc"
GREEDY_LONG = gen_pb.SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def wait_for(pred, timeout: float = 20.0, what: str = "condition"):
    """``support.wait_for`` with a longer default: engine processes start a fresh interpreter."""
    return support.wait_for(pred, timeout, what)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def redis_server():
    with RedisServer() as rs:
        yield rs


@pytest.fixture(scope="module")
def settings(models, redis_server) -> ReplicaSettings:
    return ReplicaSettings(
        host="127.0.0.1", port=0, model_cache_dir=models, num_blocks=128, torch_threads=1, max_num_seqs=4,
        max_waiting=50, replica_id="proc-replica", redis_url=redis_server.url, namespace=NAMESPACE,
        heartbeat_interval=0.2,
    )


@pytest.fixture(scope="module")
def replica(settings):
    assert settings.engine_process
    with BackgroundReplica(settings) as r:
        pid = r.server.engine.pid
        yield r
    # Stopping the server stops the engine process: no orphan.
    wait_for(lambda: not pid_alive(pid), timeout=5.0)


@pytest.fixture(scope="module")
def grpc_target(replica) -> str:
    return replica.target  # conftest's channel / gen / rep connect here


@pytest.fixture(scope="module")
def r(redis_server):
    return redis.Redis.from_url(redis_server.url)


# -- the engine runs in another process, the service behaves the same --------------------------------
def test_engine_runs_in_a_child_process_of_the_server(replica):
    pid = replica.server.engine.pid
    assert isinstance(replica.server.engine, ProcessLLMEngine)
    assert pid != os.getpid() and pid_alive(pid)


def test_stream_yields_the_engine_greedy_tokens_deltas_and_final_usage(settings, gen):
    from replica.engine.engine import LLMEngine

    prompt = "The harbour town woke before the sun. Fishing boats slid out past the breakwater."
    engine = LLMEngine(resolve_model_dir(settings)[0], settings.engine_config())
    (direct,) = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0))

    deltas = list(gen.GenerateStream(gen_pb.GenerateRequest(
        text=prompt, sampling=gen_pb.SamplingParams(max_tokens=24, temperature=0.0)
    )))
    assert [t for d in deltas for t in d.token_ids] == direct.output_token_ids
    assert all(len(d.token_ids) == 1 for d in deltas)
    assert all(d.finish_reason == gen_pb.FINISH_REASON_UNSPECIFIED for d in deltas[:-1])
    last = deltas[-1]
    assert last.finish_reason == gen_pb.FINISH_REASON_LENGTH
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (direct.num_prompt_tokens, 24)


def test_model_info_comes_from_the_engine_process(gen, rep, replica, settings):
    info = gen.GetModelInfo(gen_pb.GetModelInfoRequest())
    hasher = BlockHasher(settings.hash_algorithm, settings.hash_seed, BLOCK)
    assert info == rep.GetModelInfo(gen_pb.GetModelInfoRequest())
    assert (info.model, info.block_size, info.hash_algorithm) == ("kvroute-tiny-llama", BLOCK, "sha256_cbor")
    assert info.hash_seed_digest == hasher.seed_digest
    assert info.max_model_len == replica.server.engine.info.max_model_len > 0
    assert list(info.eos_token_ids) == list(replica.server.engine.info.eos_token_ids)
    load = rep.GetLoad(rep_pb.GetLoadRequest())
    assert load.replica_id == "proc-replica" and load.num_blocks == 128


def test_repeated_prompt_reports_cached_tokens_and_getload_counts_them(rep):
    ids = [(5 * i + 2) % 500 for i in range(3 * BLOCK + 5)]
    req = rep_pb.ReplicaGenerateRequest(token_ids=ids, sampling=gen_pb.SamplingParams(max_tokens=4, temperature=0.0))
    before = rep.GetLoad(rep_pb.GetLoadRequest())
    first, second = rep.Generate(req), rep.Generate(req)
    assert (first.usage.cached_tokens, second.usage.cached_tokens) == (0, 3 * BLOCK)
    assert list(second.token_ids) == list(first.token_ids)
    wait_for(lambda: rep.GetLoad(rep_pb.GetLoadRequest()).prefix_cache_hits >= before.prefix_cache_hits + 3 * BLOCK)


def test_chat_prompt_is_rendered_in_the_server_process(replica, gen, rep):
    tok = replica.server.engine.tokenizer
    messages = [gen_pb.ChatMessage(role="user", content="How is the harbour today?")]
    resp = gen.Generate(gen_pb.GenerateRequest(
        chat=gen_pb.ChatMessages(messages=messages), sampling=gen_pb.SamplingParams(max_tokens=3, temperature=0.0)
    ))
    expected = tok.encode(tok.apply_chat_template([{"role": "user", "content": "How is the harbour today?"}]),
                          add_special_tokens=False)
    assert resp.usage.prompt_tokens == len(expected)
    same = rep.Generate(rep_pb.ReplicaGenerateRequest(
        token_ids=expected, sampling=gen_pb.SamplingParams(max_tokens=3, temperature=0.0)
    ))
    assert list(same.token_ids) == list(resp.token_ids)


# -- bad input is refused in the server process, before the engine process sees it --------------------
def test_bad_input_is_invalid_argument_naming_the_field(gen, rep):
    info = gen.GetModelInfo(gen_pb.GetModelInfoRequest())
    ok = gen_pb.TokenIds(ids=[1, 2, 3])
    sp = gen_pb.SamplingParams
    bad = [
        (gen_pb.GenerateRequest(text=""), "prompt"),
        (gen_pb.GenerateRequest(token_ids=gen_pb.TokenIds(ids=[1] * info.max_model_len)), "prompt"),
        (gen_pb.GenerateRequest(text="harbour " * info.max_model_len), "prompt"),
        (gen_pb.GenerateRequest(token_ids=gen_pb.TokenIds(ids=[1, info.vocab_size, 2])), "prompt.token_ids"),
        (gen_pb.GenerateRequest(chat=gen_pb.ChatMessages()), "prompt.chat"),
        (gen_pb.GenerateRequest(token_ids=ok, sampling=sp(max_tokens=0)), "max_tokens"),
        (gen_pb.GenerateRequest(token_ids=ok, sampling=sp(temperature=-0.5)), "temperature"),
        (gen_pb.GenerateRequest(token_ids=ok, sampling=sp(top_p=1.5)), "top_p"),
        (gen_pb.GenerateRequest(token_ids=ok, sampling=sp(stop_token_ids=[info.vocab_size + 7])), "stop_token_ids"),
    ]
    for request, field in bad:
        for rpc in (gen.Generate, lambda q: list(gen.GenerateStream(q))):
            with pytest.raises(grpc.RpcError) as err:
                rpc(request)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
            assert err.value.details().startswith(f"{field}: "), err.value.details()
    assert idle(rep)


def test_duplicate_in_flight_request_id_is_invalid_argument(gen, rep):
    assert_duplicate_request_id_refused(gen, rep, "dup-p", GREEDY_LONG)


# -- cancellation and Abort free the blocks in the engine process ---------------------------------------
def test_client_cancel_mid_stream_frees_every_block(gen, rep, replica):
    stream = started_stream(gen, gen_pb.GenerateRequest(text="cancel me " * 20, sampling=GREEDY_LONG), 5)
    busy = wait_for(lambda: (load := rep.GetLoad(rep_pb.GetLoadRequest())).running == 1 and load)
    assert busy.kv_usage > 0 and busy.free_blocks < 127
    stream.cancel()
    wait_for(lambda: idle(rep))
    assert rep.GetLoad(rep_pb.GetLoadRequest()).free_blocks == 127
    assert replica.server.frontend.num_in_flight == 0


def test_deadline_expiry_mid_stream_is_deadline_exceeded_and_frees_every_block(gen, rep):
    stream = gen.GenerateStream(gen_pb.GenerateRequest(text="too slow " * 20, sampling=GREEDY_LONG), timeout=0.8)
    deltas_before_deadline(stream)
    wait_for(lambda: idle(rep))


def test_abort_ends_the_stream_with_finish_reason_abort(gen, rep):
    abort_mid_stream(gen, rep, "abort-p", GREEDY_LONG)
    wait_for(lambda: idle(rep))


def test_concurrent_streams_over_max_waiting_get_resource_exhausted_and_nothing_else(replica, rep):
    counts = concurrent_stream_outcomes(replica.target, 150)
    assert set(counts) <= {"OK", "RESOURCE_EXHAUSTED"} and counts.get("OK", 0) >= 50, counts
    wait_for(lambda: idle(rep))


# -- the publisher runs in the engine process -----------------------------------------------------------
def _stream_events(r: redis.Redis) -> list:
    out = []
    for _id, fields in r.xrange(RedisLayout(NAMESPACE).events_stream("proc-replica")):
        out.append((int(fields[b"seq"]), decode_batch(fields[b"batch"])[1]))
    return out


def test_heartbeat_carries_the_identity_and_the_load(replica, r):
    hb = wait_for(lambda: r.hgetall(RedisLayout(NAMESPACE).heartbeat_key("proc-replica")))
    info = replica.server.engine.info
    assert hb[b"address"].decode() == replica.server.address
    assert hb[b"hash_seed_digest"].decode() == info.hash_seed_digest
    assert int(hb[b"num_blocks"]) == info.num_blocks == 128
    assert hb[b"model"] == b"kvroute-tiny-llama"
    assert int(hb[b"free_blocks"]) <= 127


def test_request_blocks_reach_redis_as_block_stored_after_the_epoch_clear(replica, rep, r):
    prompt = [(13 * i + 1) % 500 for i in range(3 * BLOCK + 2)]
    rep.Generate(rep_pb.ReplicaGenerateRequest(token_ids=prompt, sampling=gen_pb.SamplingParams(max_tokens=2)))
    want = {to_event_int(d) for d in BlockHasher(block_size=BLOCK).hash_blocks(prompt)}
    assert len(want) == 3

    def stored() -> set[int]:
        return {h for _seq, evs in _stream_events(r) for e in evs if isinstance(e, BlockStored) for h in e.block_hashes}

    wait_for(lambda: want <= stored())
    batches = _stream_events(r)
    assert batches[0] == (1, [AllBlocksCleared(None)])
    assert [seq for seq, _ in batches] == list(range(1, len(batches) + 1))
    # The server sees the publisher's counters through the step reports.
    pub = replica.server.publisher
    wait_for(lambda: pub.stats().batches_published >= len(batches) and pub.stats().events_published >= 3)
    assert pub.stats().batches_dropped == 0 and pub.stats().connected


def test_request_snapshot_rpc_reaches_the_publisher_in_the_engine_process(rep, r):
    prompt = [(17 * i + 3) % 500 for i in range(2 * BLOCK)]
    rep.Generate(rep_pb.ReplicaGenerateRequest(token_ids=prompt, sampling=gen_pb.SamplingParams(max_tokens=1)))
    seq = rep.RequestSnapshot(rep_pb.RequestSnapshotRequest()).seq
    assert seq >= 2
    key = RedisLayout(NAMESPACE).snapshot_key("proc-replica")

    def snapshot_at_seq():
        raw = r.get(key)
        snap = events_pb2.CacheSnapshot.FromString(raw) if raw is not None else None
        return snap if snap is not None and snap.seq >= seq else None

    snap = wait_for(snapshot_at_seq)
    cached = {h for m in snap.media for h in m.block_hashes}
    assert {to_event_int(d) for d in BlockHasher(block_size=BLOCK).hash_blocks(prompt)} <= cached


def test_snapshot_request_on_redis_pubsub_reaches_the_publisher_in_the_engine_process(rep, r):
    layout = RedisLayout(NAMESPACE)
    key = layout.snapshot_key("proc-replica")
    wait_for(lambda: r.get(key))  # the epoch's first snapshot
    before = events_pb2.CacheSnapshot.FromString(r.get(key)).ts
    r.publish(layout.snapshot_requests_channel("proc-replica"), "proc-replica")
    wait_for(lambda: events_pb2.CacheSnapshot.FromString(r.get(key)).ts > before)


# -- the engine process dying ------------------------------------------------------------------------
def test_a_sigterm_to_the_engine_process_is_left_to_the_server(replica, gen):
    """A process-group stop (``kvroute up``, ``kill -TERM -PGID``) signals the engine process too: it
    ignores it (the server stops it in order), so the server never sees its engine "exit
    unexpectedly" and keeps serving until it is stopped itself."""
    engine = replica.server.engine
    os.kill(engine.pid, signal.SIGTERM)
    os.kill(engine.pid, signal.SIGINT)
    reply = gen.Generate(gen_pb.GenerateRequest(text="still here", sampling=gen_pb.SamplingParams(max_tokens=2)))
    assert reply.usage.completion_tokens == 2
    assert pid_alive(engine.pid) and engine.dead is None


def test_killed_engine_process_fails_streams_unavailable_and_health_not_serving(models):
    settings = ReplicaSettings(host="127.0.0.1", port=0, model_cache_dir=models, num_blocks=64, torch_threads=1,
                               replica_id="doomed")
    with BackgroundReplica(settings) as replica:
        channel = grpc.insecure_channel(replica.target)
        gen = gen_grpc.GenerationServiceStub(channel)
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest(service="readiness")).status == SERVING
        stream = gen.GenerateStream(gen_pb.GenerateRequest(text="doomed", sampling=GREEDY_LONG))
        next(stream)
        pid = replica.server.engine.pid
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as err:
            for _ in stream:
                pass
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "engine" in err.value.details()
        for name in ("readiness", "liveness", ""):
            wait_for(lambda name=name: health.Check(health_pb2.HealthCheckRequest(service=name)).status == NOT_SERVING)
        with pytest.raises(grpc.RpcError) as err:
            gen.Generate(gen_pb.GenerateRequest(text="after", sampling=gen_pb.SamplingParams(max_tokens=2)))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        channel.close()
    assert not pid_alive(pid)


# -- ProcessLLMEngine alone -------------------------------------------------------------------------
def num_running(engine) -> int:  # module-level: call() pickles the function
    return engine.num_running


def engine_pid(engine) -> int:
    return os.getpid()


def raise_value_error(engine) -> None:
    raise ValueError("from the engine process")


def process_engine(models, **settings) -> ProcessLLMEngine:
    """A ProcessLLMEngine of the default model in ``models`` (64 blocks, one torch thread), not started."""
    s = ReplicaSettings(model_cache_dir=models, num_blocks=64, torch_threads=1, **settings)
    return ProcessLLMEngine(functools.partial(build_process_engine, s), resolve_model_dir(s)[0])


def test_call_runs_picklable_functions_in_the_engine_process_and_refuses_lambdas(models):
    engine = process_engine(models)
    engine.start()
    try:
        async def run() -> None:
            assert await engine.call(num_running) == 0
            assert await engine.call(engine_pid) == engine.pid
            with pytest.raises(ValueError, match="from the engine process"):
                await engine.call(raise_value_error)
            with pytest.raises((TypeError, pickle.PicklingError, AttributeError)):
                engine.call(lambda e: e.num_running)
            req = engine.make_request([1, 2, 3], SamplingParams(max_tokens=5, temperature=0.0), "direct-1", None)
            outs = [o async for o in engine.generate(req)]
            assert sum(len(o.new_token_ids) for o in outs) == 5 and outs[-1].finished
            assert req.num_cached_tokens == 0  # the copy here mirrors the admission

        asyncio.run(run())
    finally:
        engine.shutdown()
    assert not pid_alive(engine.pid)


def test_startup_error_in_the_engine_process_is_raised_by_start(models):
    engine = process_engine(models, max_model_len=10**7)
    with pytest.raises(ValueError, match="^max_model_len: "):
        engine.start()
    assert not pid_alive(engine.pid)
    engine.shutdown()  # idempotent after a failed start


def test_missing_model_folder_fails_start_with_model_load_error(tmp_path):
    settings = ReplicaSettings(model=str(tmp_path / "nowhere"), num_blocks=64, torch_threads=1)
    engine = ProcessLLMEngine(functools.partial(build_process_engine, settings), tmp_path / "nowhere")
    with pytest.raises(ModelLoadError):
        engine.start()
    assert not pid_alive(engine.pid)


def test_streams_end_with_engine_dead_error_when_the_process_dies(models):
    engine = process_engine(models)
    engine.start()
    try:
        async def run() -> None:
            req = engine.make_request([1, 2, 3], SamplingParams(max_tokens=1000, ignore_eos=True), "dies", None)
            outputs = engine.generate(req)
            await outputs.__anext__()
            os.kill(engine.pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError):
                async for _ in outputs:
                    pass
            with pytest.raises(EngineDeadError):
                await engine.call(num_running)
            with pytest.raises(EngineDeadError):
                await engine.generate(engine.make_request([1], None, "after", None)).__anext__()

        asyncio.run(run())
        assert engine.dead is not None
    finally:
        engine.shutdown()
