"""Garbage in the Redis streams next to a healthy replica (router/consumer.py, "Hostile input" in
router/consumer_feed.py), against a real redis-server: entries with no fields, a replica id that
is not UTF-8, a non-integer seq, a truncated batch, a batch of absurd block size, one in the wrong
shard; an undecodable snapshot, heartbeats that name nobody, are not hashes (WRONGTYPE) or have
a key that is not UTF-8. The consumer keeps running, counts each under its reason, and the
healthy replica (a real RedisEventPublisher) is indexed exactly."""

from __future__ import annotations

from kvroute.events import BlockStored, encode_batch
from kvroute.redis_layout import F_BATCH, F_EPOCH, F_REPLICA_ID, F_SEQ, RedisLayout
from tests import support_redis
from tests.support import wait_for

server = support_redis.redis_server
redis_client = support_redis.redis_client

E = 1_700_000_000_000_000_000
VALID = encode_batch([BlockStored((11, 12), None, (), 16)], ts=0.0)


FEED_REASONS = ("undecodable", "block_size")  # found by IndexFeed, which ignores backlog of unknown replicas


def _garbage(layout: RedisLayout, seq: int) -> list[tuple[str, dict, str]]:
    """(stream, fields, the reason it is rejected under) of each hostile entry; ``seq`` and up for
    the decodable ones."""
    evil = layout.events_stream("evil")
    other = next(s for s in layout.all_event_streams() if s != evil)
    epoch = str(E).encode()
    return [
        (evil, {b"junk": b"1"}, "fields"),
        (evil, {F_REPLICA_ID: b"\xff\xfe", F_EPOCH: b"1", F_SEQ: b"1", F_BATCH: VALID}, "replica_id"),
        (evil, {F_REPLICA_ID: b"evil", F_EPOCH: epoch, F_SEQ: b"one", F_BATCH: VALID}, "fields"),
        (evil, {F_REPLICA_ID: b"evil", F_EPOCH: epoch, F_SEQ: b"%d" % seq, F_BATCH: VALID[:-3]}, "undecodable"),
        (evil, {F_REPLICA_ID: b"evil", F_EPOCH: epoch, F_SEQ: b"%d" % (seq + 1),
                F_BATCH: encode_batch([BlockStored((5,), None, (), 4096)], ts=0.0)}, "block_size"),
        (other, {F_REPLICA_ID: b"evil", F_EPOCH: epoch, F_SEQ: b"%d" % (seq + 2), F_BATCH: VALID}, "wrong_stream"),
    ]


def test_garbage_entries_next_to_a_healthy_replica_are_counted_and_it_is_indexed(server, redis_client):
    layout = RedisLayout(namespace="test", num_shards=2)
    rep = support_redis.FakeReplica(server, layout, "healthy")
    try:
        rep.steps(3)
        rounds = [_garbage(layout, seq) for seq in (1, 1, 11)]  # the first before the consumer starts
        for stream, fields, _reason in rounds[0]:
            redis_client.xadd(stream, fields)
        redis_client.set(layout.snapshot_key("evil"), b"\x0a\xff")  # read when the lost entries open a gap
        redis_client.hset(layout.heartbeat_key("ghost"), mapping={"epoch": "soon"})  # names nobody
        redis_client.set(layout.heartbeat_key("wrongtype"), b"not a hash")  # HGETALL: WRONGTYPE
        redis_client.set(layout.heartbeat_key("x").encode()[:-1] + b"\xff", b"x")  # a non-UTF-8 key
        with support_redis.running_consumer(server, layout) as consumer:
            for garbage in rounds[1:]:
                rep.steps(3)
                for stream, fields, _reason in garbage:
                    redis_client.xadd(stream, fields)
            rep.steps(3)
            expected: dict[str, int] = {}
            for i, garbage in enumerate(rounds):
                for _stream, _fields, reason in garbage:
                    if i or reason not in FEED_REASONS:
                        expected[reason] = expected.get(reason, 0) + 1
            wait_for(lambda: all(consumer.rejected[r] >= n for r, n in expected.items())
                     and consumer.rejected["heartbeat"] >= 3, what="every garbage entry rejected")
            support_redis.wait_synced(consumer, [rep])
            assert {r: consumer.rejected[r] for r in expected} == expected == {
                "fields": 6, "replica_id": 3, "wrong_stream": 3, "undecodable": 2, "block_size": 2}
            assert consumer.rejected["error"] == 0 and consumer.connected and consumer.reconnects == 0
            assert not consumer.entries().get("evil")
            assert support_redis.indexed(consumer, "healthy") == rep.cached()
    finally:
        rep.close()
