"""RedisEventPublisher against a real redis-server (replica/publisher/, DESIGN.md §3.3, §4).

The reader in these tests does what the router's consumer will do: XRANGE the stream, decode each
batch and feed it to ReplicaCacheState, loading the snapshot when it starts late or sees a gap.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

import pytest
import redis

from kvroute.engine_info import EngineInfo
from kvroute.events import CPU, GPU, AllBlocksCleared, BlockRemoved, BlockStored, decode_batch
from kvroute.heartbeat import FIELDS, EngineLoad, Heartbeat
from kvroute.ordering import BatchResult, ReplicaCacheState
from kvroute.redis_layout import F_BATCH, F_EPOCH, F_REPLICA_ID, F_SEQ, RedisLayout
from kvroute.snapshot import CacheSnapshot, decode_snapshot
from kvroute_tools.redis_server import RedisServer
from replica.publisher import RedisEventPublisher
from tests.support import wait_for

REPLICA = "replica-a"
ADDRESS = "127.0.0.1:50051"
INFO = EngineInfo(
    model="kvroute-tiny-llama", vocab_size=529, max_model_len=2048, block_size=16, num_blocks=64,
    hash_algorithm="sha256_cbor", hash_seed_digest="9bd96a485ad84efd",
)
LOAD = EngineLoad(free_blocks=40, running=2, waiting=1, usage=0.375, queued_prefill_tokens=96)


# -- helpers ----------------------------------------------------------------------------------------
def read_entries(
    r: redis.Redis, layout: RedisLayout, replica_id: str = REPLICA
) -> list[tuple[int, int, list]]:
    """(epoch, seq, events) of every stream entry of ``replica_id``, in stream order."""
    out = []
    for _id, fields in r.xrange(layout.events_stream(replica_id)):
        if fields[F_REPLICA_ID].decode() != replica_id:
            continue
        _ts, events = decode_batch(fields[F_BATCH])
        out.append((int(fields[F_EPOCH]), int(fields[F_SEQ]), events))
    return out


def load_snapshot(r: redis.Redis, layout: RedisLayout, replica_id: str = REPLICA) -> CacheSnapshot:
    data = r.get(layout.snapshot_key(replica_id))
    assert data is not None, "no snapshot in Redis"
    return decode_snapshot(data)


def replay(r: redis.Redis, layout: RedisLayout, *, from_snapshot: bool) -> ReplicaCacheState:
    """A reader: from the stream start (or from the snapshot), resyncing from the snapshot on a gap."""
    state = ReplicaCacheState()
    if from_snapshot:
        state.load_snapshot(load_snapshot(r, layout))
    for epoch, seq, events in read_entries(r, layout):
        if state.apply_batch(epoch, seq, events) is BatchResult.GAP:
            snap = load_snapshot(r, layout)
            assert (snap.epoch, snap.seq) >= (epoch, seq - 1), "the snapshot does not cover the gap"
            state.load_snapshot(snap)
            assert state.apply_batch(epoch, seq, events) is not BatchResult.GAP
    return state


def multiset(cached: Mapping[str, Sequence[int]]) -> dict[str, Counter]:
    return {m: Counter(hashes) for m, hashes in cached.items()}


class FakeCache:
    """A replica's cache without an engine: a ReplicaCacheState is the truth, events come from a rng."""

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)
        self.truth = ReplicaCacheState()

    def step(self) -> list:
        held = list(self.truth.as_multiset()[GPU].elements())
        events: list = []
        if held:
            victim = self.rng.choice(held)
            events += [BlockRemoved((victim,), GPU), BlockStored((victim,), None, (), 0, None, CPU, None)]
        events.append(BlockStored(tuple(self.rng.getrandbits(64) for _ in range(3)), None, (), 16))
        self.truth.apply_events(events)
        return events

    def snapshot(self) -> dict[str, list[int]]:
        return {m: list(c.elements()) for m, c in self.truth.as_multiset().items()}


@pytest.fixture
def server():
    with RedisServer() as s:
        yield s


@pytest.fixture
def layout():
    return RedisLayout(namespace="pubtest")


def make_publisher(server: RedisServer, layout: RedisLayout, **kw) -> RedisEventPublisher:
    kw.setdefault("heartbeat_interval", 0.2)
    return RedisEventPublisher(server.url, layout, REPLICA, INFO, ADDRESS, **kw)


# -- without an engine --------------------------------------------------------------------------------
def test_first_batch_of_an_epoch_is_all_blocks_cleared_alone(server, layout):
    pub = make_publisher(server, layout)
    pub.start()
    try:
        cache = FakeCache()
        pub.on_step(cache.step(), LOAD, cache.snapshot)
        wait_for(lambda: pub.last_seq_written == 2, what="both batches written")
        entries = read_entries(redis.Redis.from_url(server.url), layout)
        assert entries[0] == (pub.epoch, 1, [AllBlocksCleared(medium=None)])
        assert [seq for _, seq, _ in entries] == [1, 2]
    finally:
        pub.close()


def test_heartbeat_has_every_field_and_a_ttl_and_expires_after_close(server, layout):
    r = redis.Redis.from_url(server.url, decode_responses=True)
    key = layout.heartbeat_key(REPLICA)
    pub = make_publisher(server, layout, heartbeat_interval=0.2)
    pub.start()
    try:
        cache = FakeCache()
        pub.on_step(cache.step(), LOAD, cache.snapshot)
        wait_for(lambda: r.hget(key, "last_seq") == "2", what="a heartbeat with last_seq 2")
        hb = r.hgetall(key)
        assert set(hb) == set(FIELDS)
        beat = Heartbeat.from_redis(hb)
        assert beat == Heartbeat.of(
            INFO, replica_id=REPLICA, address=ADDRESS, epoch=pub.epoch, last_seq=2, load=LOAD, ts=beat.ts
        )
        assert hb == beat.to_redis()  # every field as the record writes it, e.g. usage "0.375"
        assert (hb["model"], hb["block_size"], hb["free_blocks"], hb["usage"]) == (
            "kvroute-tiny-llama", "16", "40", "0.375"
        )
        assert 0 < r.pttl(key) <= 600  # 3 heartbeats of 0.2 s
        first_ts = hb["ts"]
        wait_for(lambda: r.hget(key, "ts") != first_ts, what="the next heartbeat")
    finally:
        pub.close()
    assert r.pttl(key) > 0, "close() leaves the key to its TTL"
    wait_for(lambda: not r.exists(key), timeout=1.5, what="the heartbeat to expire")


def test_snapshot_request_on_the_channel_gets_a_snapshot_at_the_last_seq(server, layout):
    r = redis.Redis.from_url(server.url)
    pub = make_publisher(server, layout, snapshot_interval=3600)
    pub.start()
    try:
        cache = FakeCache()

        def idle_hook_until(cond: Callable[[], bool], what: str) -> None:
            wait_for(lambda: pub.on_step([], LOAD, cache.snapshot) or cond(), what=what)

        idle_hook_until(lambda: pub.snapshots_written == 1, "the epoch's first snapshot")
        for _ in range(3):
            pub.on_step(cache.step(), LOAD, cache.snapshot)
        r.publish(layout.snapshot_requests_channel(), "some-other-replica")
        r.publish(layout.snapshot_requests_channel(), REPLICA)
        idle_hook_until(lambda: pub.snapshots_written == 2, "the requested snapshot")
        snap = load_snapshot(r, layout)
        assert (snap.replica_id, snap.epoch, snap.seq) == (REPLICA, pub.epoch, 4)
        assert multiset(snap.media) == cache.truth.as_multiset()

        pub.on_step(cache.step(), LOAD, cache.snapshot)
        pub.request_snapshot()  # the RequestSnapshot rpc's path
        idle_hook_until(lambda: pub.snapshots_written == 3, "the rpc-requested snapshot")
        assert load_snapshot(r, layout).seq == 5
    finally:
        pub.close()


def test_stream_is_trimmed_to_about_maxlen(server, layout):
    r = redis.Redis.from_url(server.url)
    pub = make_publisher(server, layout, stream_maxlen=10)
    pub.start()
    try:
        for i in range(400):
            pub.on_step([BlockStored((i,), None, (), 16)], LOAD, dict)
        wait_for(lambda: pub.last_seq_written == 401, what="every batch written")
        # Approximate MAXLEN trims whole stream nodes (100 entries by default), never below 10.
        assert 10 <= r.xlen(layout.events_stream(REPLICA)) <= 110
    finally:
        pub.close()


def test_on_step_never_raises_into_the_engine(server, layout):
    pub = make_publisher(server, layout)
    pub.start()
    try:
        wait_for(lambda: pub.connected, what="connected")

        def broken_snapshot():
            raise RuntimeError("boom")

        pub.on_step([BlockStored((1,), None, (), 16)], LOAD, broken_snapshot)  # must not raise
        pub.on_step(["not an event"], LOAD, dict)  # encoding fails: logged, not raised
        pub.on_engine_step(object())  # not an engine at all
    finally:
        pub.close()


def test_buffer_overflow_drops_batches_and_the_snapshot_covers_the_gap(layout):
    server = RedisServer()  # its port, not started yet: Redis is down when the replica starts
    r = redis.Redis.from_url(server.url)
    pub = make_publisher(server, layout, buffer_size=2, snapshot_interval=3600)
    pub.start()
    try:
        cache = FakeCache()
        for _ in range(4):  # seq 2 fills the buffer (seq 1 is the clear); seqs 3, 4, 5 are dropped
            pub.on_step(cache.step(), LOAD, cache.snapshot)
        assert (pub.last_seq, pub.batches_dropped, pub.connected) == (5, 3, False)

        server.start()
        wait_for(
            lambda: pub.on_step([], LOAD, cache.snapshot) or pub.snapshots_written == 1,
            what="reconnect and a snapshot",
        )
        pub.on_step(cache.step(), LOAD, cache.snapshot)
        wait_for(lambda: pub.last_seq_written == 6, what="seq 6 written")

        assert [seq for _, seq, _ in read_entries(r, layout)] == [1, 2, 6]
        assert load_snapshot(r, layout).seq == 5
        assert replay(r, layout, from_snapshot=False).as_multiset() == cache.truth.as_multiset()
        assert pub.batches_published == 3 and pub.batches_dropped == 3
    finally:
        pub.close()
        server.close()


# -- through a real engine ------------------------------------------------------------------------------
ENGINE_NUM_BLOCKS = 64  # small, so the workload evicts (and offloads to the CPU tier)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    from replica.model.default_model import ensure_default_model

    return ensure_default_model(tmp_path_factory.mktemp("model") / "tiny")


def make_engine(model_dir):
    from replica.engine.config import EngineConfig
    from replica.engine.engine import LLMEngine

    cfg = EngineConfig(device="cpu", num_blocks=ENGINE_NUM_BLOCKS, cpu_offload_blocks=16, torch_threads=1)
    return LLMEngine(model_dir, cfg)


def make_prompts(seed: int, n: int) -> list[list[int]]:
    """Prompts over a few shared prefixes (prefix hits), of mixed lengths (evictions)."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(10, 500) for _ in range(64)] for _ in range(3)]
    return [
        rng.choice(prefixes)[: rng.choice((16, 32, 48, 64))]
        + [rng.randrange(10, 500) for _ in range(rng.randrange(4, 60))]
        for _ in range(n)
    ]


class TimedHook:
    """The step hook, timed: the publisher must never block the engine thread."""

    def __init__(self, pub: RedisEventPublisher):
        self.pub = pub
        self.max_s = 0.0
        self.calls = 0

    def __call__(self, engine) -> None:
        t0 = time.perf_counter()
        self.pub.on_engine_step(engine)
        self.max_s = max(self.max_s, time.perf_counter() - t0)
        self.calls += 1


def run_workload(aeng, prompts: list[list[int]]) -> list:
    from replica.engine.params import SamplingParams

    async def one(prompt):
        req = aeng.make_request(prompt, SamplingParams(max_tokens=8, temperature=0), None, None)
        last = None
        async for out in aeng.generate(req):
            last = out
        return last

    async def main():
        return await asyncio.gather(*(one(p) for p in prompts))

    return asyncio.run(main())


def engine_cached(aeng) -> dict[str, Counter]:
    """The engine's cached set, read on the engine thread (so the step hook of the last step has run)."""

    async def main():
        return await aeng.call(lambda e: multiset(e.kv.cached_event_hashes()))

    return asyncio.run(main())


def settle(aeng, pub: RedisEventPublisher) -> dict[str, Counter]:
    """The engine's set once idle, after the publisher has written every batch assigned so far."""
    expected = engine_cached(aeng)
    wait_for(lambda: pub.last_seq_written == pub.last_seq, what="the publisher to flush")
    return expected


def start_replica(model_dir, server, layout, **kw):
    from replica.engine.async_engine import AsyncLLMEngine

    engine = make_engine(model_dir)
    pub = RedisEventPublisher(
        server.url, layout, REPLICA, engine.info("kvroute-tiny-llama"), ADDRESS, heartbeat_interval=0.2, **kw
    )
    hook = TimedHook(pub)
    aeng = AsyncLLMEngine(engine, step_hook=hook)
    pub.start()
    aeng.start()
    return aeng, pub, hook


@pytest.fixture(scope="module")
def published_run(model_dir):
    """One replica: workload, a snapshot requested on the channel, more workload."""
    layout = RedisLayout(namespace="pubrun")
    with RedisServer() as server:
        r = redis.Redis.from_url(server.url)
        aeng, pub, hook = start_replica(model_dir, server, layout, snapshot_interval=3600)
        try:
            run_workload(aeng, make_prompts(1, 24))
            settle(aeng, pub)
            wait_for(lambda: pub.snapshots_written >= 1, what="the first snapshot")
            written = pub.snapshots_written
            r.publish(layout.snapshot_requests_channel(), REPLICA)
            wait_for(lambda: pub.snapshots_written > written, what="the requested snapshot")
            run_workload(aeng, make_prompts(2, 24))
            expected = settle(aeng, pub)
            yield r, layout, pub, expected, aeng.engine, hook
        finally:
            aeng.shutdown()
            pub.close()


def test_stream_replay_reproduces_the_engine_cached_set(published_run):
    r, layout, pub, expected, engine, _ = published_run
    assert engine.kv.stats.hits > 0, "the workload should hit the prefix cache"
    assert expected[CPU], "the workload should offload to the CPU tier"
    entries = read_entries(r, layout)
    assert [seq for _, seq, _ in entries] == list(range(1, pub.last_seq + 1))
    assert any(isinstance(e, BlockRemoved) for _, _, events in entries for e in events), "no evictions"
    state = replay(r, layout, from_snapshot=False)
    assert state.as_multiset() == expected
    assert state.num_missing_removals == 0
    assert pub.batches_dropped == 0 and pub.events_published == sum(len(ev) for _, _, ev in entries)


def test_late_reader_from_the_snapshot_reaches_the_same_set(published_run):
    r, layout, pub, expected, _, _ = published_run
    snap = load_snapshot(r, layout)
    assert snap.epoch == pub.epoch and 1 <= snap.seq < pub.last_seq
    assert replay(r, layout, from_snapshot=True).as_multiset() == expected


def test_restart_starts_a_new_epoch_that_readers_take_over(model_dir, server, layout):
    r = redis.Redis.from_url(server.url)
    aeng, pub, _ = start_replica(model_dir, server, layout)
    try:
        run_workload(aeng, make_prompts(3, 12))
        old = settle(aeng, pub)
    finally:
        aeng.shutdown()
        pub.close()
    assert replay(r, layout, from_snapshot=False).as_multiset() == old

    aeng, pub2, _ = start_replica(model_dir, server, layout)
    try:
        assert pub2.epoch > pub.epoch
        run_workload(aeng, make_prompts(4, 6))
        new = settle(aeng, pub2)
    finally:
        aeng.shutdown()
        pub2.close()
    assert new != old
    first_new = next(e for e in read_entries(r, layout) if e[0] == pub2.epoch)
    assert first_new == (pub2.epoch, 1, [AllBlocksCleared(medium=None)])
    assert replay(r, layout, from_snapshot=False).as_multiset() == new


def test_redis_down_keeps_the_engine_serving_and_readers_resync_after(model_dir, server, layout):
    aeng, pub, hook = start_replica(model_dir, server, layout, snapshot_interval=3600)
    try:
        run_workload(aeng, make_prompts(5, 8))
        settle(aeng, pub)
        server.stop()
        hook.max_s = 0.0
        outs = run_workload(aeng, make_prompts(6, 16))
        assert all(o.finished for o in outs), "requests must complete while Redis is down"
        wait_for(lambda: not pub.connected, what="the publisher to notice")
        assert hook.max_s < 0.05, f"on_step blocked the engine for {hook.max_s * 1000:.1f} ms"

        written = pub.snapshots_written
        server.start()  # same port, empty: everything before is gone
        r = redis.Redis.from_url(server.url)
        wait_for(
            lambda: r.exists(layout.heartbeat_key(REPLICA)), timeout=5, what="the heartbeat after restart"
        )
        wait_for(lambda: pub.snapshots_written > written, timeout=5, what="a fresh snapshot")
        assert pub.reconnects >= 1
        run_workload(aeng, make_prompts(7, 8))
        expected = settle(aeng, pub)
        assert replay(r, layout, from_snapshot=True).as_multiset() == expected
        assert hook.max_s < 0.05, f"on_step blocked the engine for {hook.max_s * 1000:.1f} ms"
    finally:
        aeng.shutdown()
        pub.close()
