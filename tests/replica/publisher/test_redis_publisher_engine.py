"""RedisEventPublisher through a real engine (replica/publisher/, DESIGN.md §3.3, §4): a reader of
the stream (tests.support_redis.replay) reaches the engine's cached set, across snapshots, a restart and
a Redis outage, and the step hook never blocks the engine thread. Without an engine:
test_redis_publisher.py.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter

import pytest
import redis

from kvroute.events import CPU, AllBlocksCleared, BlockRemoved
from kvroute.redis_layout import RedisLayout
from kvroute_tools.redis_server import RedisServer
from replica.engine.step_hook import take_step_sample
from replica.publisher import RedisEventPublisher
from tests import support_redis
from tests.support import make_cpu_engine, wait_for
from tests.support_redis import read_entries, read_snapshot, replay

REPLICA = "replica-a"
ADDRESS = "127.0.0.1:50051"

# The shared fixtures (tests.support), under the names the tests take.
server = support_redis.redis_server
layout = support_redis.redis_layout


def multiset(cached) -> dict[str, Counter]:
    return {m: Counter(hashes) for m, hashes in cached.items()}


ENGINE_NUM_BLOCKS = 64  # small, so the workload evicts (and offloads to the CPU tier)


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
        take_step_sample(engine, self.pub)
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

    engine = make_cpu_engine(model_dir, num_blocks=ENGINE_NUM_BLOCKS, cpu_offload_blocks=16)
    pub = RedisEventPublisher(
        server.url, layout, REPLICA, engine.info("kvroute-tiny-llama"), ADDRESS, heartbeat_interval=0.2, **kw
    )
    hook = TimedHook(pub)
    aeng = AsyncLLMEngine(engine, step_hook=hook)
    pub.start()
    aeng.start()
    return aeng, pub, hook


@pytest.fixture(scope="module")
def published_run(default_model_dir):
    """One replica: workload, a snapshot requested on the channel, more workload."""
    layout = RedisLayout(namespace="pubrun")
    with RedisServer() as server:
        r = redis.Redis.from_url(server.url)
        aeng, pub, hook = start_replica(default_model_dir, server, layout, snapshot_interval=3600)
        try:
            run_workload(aeng, make_prompts(1, 24))
            settle(aeng, pub)
            wait_for(lambda: pub.snapshots_written >= 1, what="the first snapshot")
            written = pub.snapshots_written
            r.publish(layout.snapshot_requests_channel(REPLICA), REPLICA)
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
    entries = read_entries(r, layout, REPLICA)
    assert [seq for _, seq, _ in entries] == list(range(1, pub.last_seq + 1))
    assert any(isinstance(e, BlockRemoved) for _, _, events in entries for e in events), "no evictions"
    state = replay(r, layout, REPLICA, from_snapshot=False)
    assert state.as_multiset() == expected
    assert state.num_missing_removals == 0
    assert pub.batches_dropped == 0 and pub.events_published == sum(len(ev) for _, _, ev in entries)


def test_late_reader_from_the_snapshot_reaches_the_same_set(published_run):
    r, layout, pub, expected, _, _ = published_run
    snap = read_snapshot(r, layout, REPLICA)
    assert snap.epoch == pub.epoch and 1 <= snap.seq < pub.last_seq
    assert replay(r, layout, REPLICA, from_snapshot=True).as_multiset() == expected


def test_restart_starts_a_new_epoch_that_readers_take_over(default_model_dir, server, layout):
    r = redis.Redis.from_url(server.url)
    aeng, pub, _ = start_replica(default_model_dir, server, layout)
    try:
        run_workload(aeng, make_prompts(3, 12))
        old = settle(aeng, pub)
    finally:
        aeng.shutdown()
        pub.close()
    assert replay(r, layout, REPLICA, from_snapshot=False).as_multiset() == old

    aeng, pub2, _ = start_replica(default_model_dir, server, layout)
    try:
        assert pub2.epoch > pub.epoch
        run_workload(aeng, make_prompts(4, 6))
        new = settle(aeng, pub2)
    finally:
        aeng.shutdown()
        pub2.close()
    assert new != old
    first_new = next(e for e in read_entries(r, layout, REPLICA) if e[0] == pub2.epoch)
    assert first_new == (pub2.epoch, 1, [AllBlocksCleared(medium=None)])
    assert replay(r, layout, REPLICA, from_snapshot=False).as_multiset() == new


def test_redis_down_keeps_the_engine_serving_and_readers_resync_after(default_model_dir, server, layout):
    aeng, pub, hook = start_replica(default_model_dir, server, layout, snapshot_interval=3600)
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
        assert replay(r, layout, REPLICA, from_snapshot=True).as_multiset() == expected
        assert hook.max_s < 0.05, f"on_step blocked the engine for {hook.max_s * 1000:.1f} ms"
    finally:
        aeng.shutdown()
        pub.close()
