"""RedisEventPublisher against a real redis-server, without an engine (replica/publisher/,
DESIGN.md §3.3, §4); through a real engine: test_redis_publisher_engine.py.

The reader in these tests does what the router's consumer does: XRANGE the stream, decode each
batch and feed it to ReplicaCacheState, loading the snapshot when it starts late or sees a gap
(tests.support_redis.replay).
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from types import SimpleNamespace

import pytest
import redis

from kvroute.engine_info import EngineInfo
from kvroute.events import CPU, GPU, AllBlocksCleared, BlockRemoved, BlockStored
from kvroute.heartbeat import FIELDS, EngineLoad, Heartbeat
from kvroute.ordering import ReplicaCacheState
from kvroute.redis_layout import RedisLayout
from kvroute_tools.redis_server import RedisServer
from replica.engine.step_hook import take_step_sample
from replica.engine.step_rates import StepRates
from replica.kv import PrefixCacheStats
from replica.publisher import NullEventPublisher, PublisherStats, RedisEventPublisher
from tests import support_redis
from tests.support import wait_for
from tests.support_redis import read_entries, read_snapshot, replay

REPLICA = "replica-a"
ADDRESS = "127.0.0.1:50051"
INFO = EngineInfo(
    model="kvroute-tiny-llama", vocab_size=529, max_model_len=2048, block_size=16, num_blocks=64,
    hash_algorithm="sha256_cbor", hash_seed_digest="9bd96a485ad84efd", attn_backend="triton",
    attn_backend_reason="no flash-attention build pages block_size 16 (flash_attn pages multiples of 256)",
)
LOAD = EngineLoad(free_blocks=40, running=2, waiting=1, usage=0.375, queued_prefill_tokens=96)


# -- helpers ----------------------------------------------------------------------------------------
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


# The shared fixtures (tests.support), under the names the tests take.
server = support_redis.redis_server
layout = support_redis.redis_layout


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
        entries = read_entries(redis.Redis.from_url(server.url), layout, REPLICA)
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
        assert (hb["attn_backend"], hb["attn_backend_reason"]) == (INFO.attn_backend, INFO.attn_backend_reason)
        assert (hb["vocab_size"], hb["max_model_len"]) == ("529", "2048")  # the model limits, for the router
        assert 0 < r.pttl(key) <= 600  # 3 heartbeats of 0.2 s
        first_ts = hb["ts"]
        wait_for(lambda: r.hget(key, "ts") != first_ts, what="the next heartbeat")
    finally:
        pub.close()
    assert r.pttl(key) > 0, "close() leaves the key to its TTL"
    wait_for(lambda: not r.exists(key), timeout=1.5, what="the heartbeat to expire")


def test_a_heartbeat_ttl_given_outlives_three_intervals_and_one_shorter_than_an_interval_is_refused(server, layout):
    r = redis.Redis.from_url(server.url, decode_responses=True)
    key = layout.heartbeat_key(REPLICA)
    pub = make_publisher(server, layout, heartbeat_interval=0.2, heartbeat_ttl=4.0)
    pub.start()
    try:
        wait_for(lambda: r.exists(key), what="the first heartbeat")
        assert 600 < r.pttl(key) <= 4000
    finally:
        pub.close()
        r.delete(key)
    with pytest.raises(ValueError, match="heartbeat_ttl: must be >= heartbeat_interval"):
        make_publisher(server, layout, heartbeat_interval=0.2, heartbeat_ttl=0.1)


def test_start_draining_writes_a_draining_heartbeat_at_once_and_every_one_after(server, layout):
    r = redis.Redis.from_url(server.url, decode_responses=True)
    key = layout.heartbeat_key(REPLICA)
    pub = make_publisher(server, layout, heartbeat_interval=30.0)  # the next periodic one is far away
    pub.start()
    try:
        wait_for(lambda: r.hget(key, "draining") == "0", what="the first heartbeat, not draining")
        first_ts = r.hget(key, "ts")
        pub.start_draining()
        wait_for(lambda: r.hget(key, "draining") == "1", timeout=2.0, what="a draining heartbeat at once")
        beat = Heartbeat.from_redis(r.hgetall(key))
        assert beat.draining and beat.ts > float(first_ts) and beat.invalid == ()
        pub.on_step([], LOAD, dict)  # a later step's load does not undo it
        assert Heartbeat.from_redis(r.hgetall(key)).draining
    finally:
        pub.close()
        r.delete(key)


def test_a_silent_serving_process_gets_its_heartbeat_withheld_until_it_speaks_again(server, layout):
    r = redis.Redis.from_url(server.url, decode_responses=True)
    key = layout.heartbeat_key(REPLICA)
    pub = make_publisher(server, layout, heartbeat_interval=0.1)  # TTL 0.3 s
    pub.start()
    try:
        wait_for(lambda: r.exists(key), what="a heartbeat before the serving process ever spoke")
        pub.serving_alive()
        first_ts = r.hget(key, "ts")
        wait_for(lambda: r.hget(key, "ts") != first_ts, what="heartbeats while it speaks")
        # Silent from here: at most one more heartbeat within the TTL, then none, and the key expires.
        wait_for(lambda: not r.exists(key), timeout=2.0, what="the heartbeat key to expire")
        time.sleep(0.3)
        assert not r.exists(key), "no heartbeat while the serving process stays silent"
        pub.serving_alive()
        wait_for(lambda: r.exists(key), timeout=1.0, what="heartbeats to resume once it speaks")
        # A draining replica's heartbeat goes out even with the serving process silent.
        pub.start_draining()
        wait_for(lambda: r.hget(key, "draining") == "1", timeout=1.0, what="the draining heartbeat")
        time.sleep(0.5)
        assert r.hget(key, "draining") == "1", "a draining replica keeps heartbeating"
    finally:
        pub.close()
        r.delete(key)


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
        r.publish(layout.snapshot_requests_channel(REPLICA), "some-other-replica")  # its shard's channel
        r.publish(layout.snapshot_requests_channel(REPLICA), REPLICA)
        idle_hook_until(lambda: pub.snapshots_written == 2, "the requested snapshot")
        snap = read_snapshot(r, layout, REPLICA)
        assert (snap.replica_id, snap.epoch, snap.seq) == (REPLICA, pub.epoch, 4)
        assert multiset(snap.media) == cache.truth.as_multiset()

        pub.on_step(cache.step(), LOAD, cache.snapshot)
        pub.request_snapshot()  # the RequestSnapshot rpc's path
        idle_hook_until(lambda: pub.snapshots_written == 3, "the rpc-requested snapshot")
        assert read_snapshot(r, layout, REPLICA).seq == 5
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
    finally:
        pub.close()


class StubEngine:
    """What the step hook (replica.engine.step_hook) reads of an ``LLMEngine``: the KV manager and
    its stats, the scheduler's queues, the measured step rates, the events."""

    def __init__(self, events: list):
        self.events = events
        self.kv = SimpleNamespace(num_free_blocks=40, num_blocks=64, usage=0.375, cached_event_hashes=dict,
                                  stats=PrefixCacheStats())
        self.scheduler = SimpleNamespace(running=[object(), object()], waiting=[object()], queued_prefill_tokens=96,
                                         num_preemptions=0)
        self.num_steps = 0
        self.step_timer = SimpleNamespace(rates=StepRates(prefill_tokens_per_s=5000.0, decode_seconds_per_running=0.004))

    def take_kv_events(self) -> list:
        events, self.events = self.events, []
        return events


def test_the_step_hook_takes_the_engine_events_and_load_even_when_nothing_is_published():
    seen = []

    class Recording(NullEventPublisher):
        def on_step(self, events, load, snapshot_fn):
            seen.append((list(events), load))

    engine = StubEngine([BlockStored((1,), None, (), 16)])
    take_step_sample(engine, Recording())
    measured = dataclasses.replace(LOAD, prefill_tokens_per_s=5000.0, decode_seconds_per_running=0.004)
    assert seen == [([BlockStored((1,), None, (), 16)], measured)] and engine.events == []
    engine.events = [BlockStored((2,), None, (), 16)]
    null = NullEventPublisher()
    null.start()
    take_step_sample(engine, null)  # emptied and dropped: the engine's list never grows
    assert engine.events == [] and null.stats() == PublisherStats()
    null.close()


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

        assert [seq for _, seq, _ in read_entries(r, layout, REPLICA)] == [1, 2, 6]
        assert read_snapshot(r, layout, REPLICA).seq == 5
        assert replay(r, layout, REPLICA, from_snapshot=False).as_multiset() == cache.truth.as_multiset()
        assert pub.batches_published == 3 and pub.batches_dropped == 3
    finally:
        pub.close()
        server.close()
