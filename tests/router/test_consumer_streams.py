"""router.consumer_streams.StreamReads against a real redis-server: one blocking XREAD per group of
streams (a Redis Cluster's: one stream each), each on its own thread, so an entry on any group comes
back without waiting on the others' block."""

from __future__ import annotations

import threading
import time

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from router.consumer_streams import StreamReads
from tests import support_redis

server = support_redis.redis_server
r = support_redis.redis_client

STREAMS = ["s:0", "s:1", "s:2"]


@pytest.fixture
def reads():
    reads = StreamReads([[s] for s in STREAMS], count=10)
    yield reads
    reads.close()


def _read_until(reads, client, positions, want: int, timeout: float = 5.0) -> list[tuple[str, bytes]]:
    """(stream, entry id) of what ``read`` calls bring back, positions advanced as the consumer
    does, until ``want`` entries are in."""
    got: list[tuple[str, bytes]] = []
    deadline = time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        for stream, entries in reads.read(client, positions, block_ms=100):
            got += [(stream, eid) for eid, _fields in entries]
            positions[stream] = entries[-1][0]
    return got


def test_an_entry_on_one_stream_comes_back_while_the_others_still_block(server, r, reads):
    positions = dict.fromkeys(STREAMS, b"0-0")
    threading.Timer(0.2, lambda: r.xadd("s:2", {"k": "2"})).start()
    started = time.monotonic()
    (stream, entries), = reads.read(r, positions, block_ms=3000)
    assert stream == "s:2" and entries[0][1] == {b"k": b"2"}
    assert time.monotonic() - started < 2  # not the others' 3 s block
    positions["s:2"] = entries[-1][0]
    later = r.xadd("s:0", {"k": "0"})  # s:0's read out since the first call brings it
    started = time.monotonic()
    assert reads.read(r, positions, block_ms=3000) == [("s:0", [(later, {b"k": b"0"})])]
    assert time.monotonic() - started < 2


def test_an_empty_reply_is_read_again_at_once_not_after_the_call(server, r, reads):
    positions = dict.fromkeys(STREAMS, b"0-0")
    assert reads.read(r, positions, block_ms=50) == []  # each read blocked 50 ms; they come back empty
    threading.Timer(0.3, lambda: r.xadd("s:1", {"k": "1"})).start()
    started = time.monotonic()
    assert [s for s, _ in reads.read(r, positions, block_ms=2000)] == ["s:1"]
    assert time.monotonic() - started < 1


def test_a_reply_from_before_reset_is_dropped_and_the_stream_read_again(server, r, reads):
    positions = dict.fromkeys(STREAMS, b"0-0")
    first = r.xadd("s:1", {"k": "1"})
    assert reads.read(r, positions, block_ms=1000) == [("s:1", [(first, {b"k": b"1"})])]  # s:0, s:2 still out
    reads.reset()  # positions not advanced: s:1 is read again from 0-0, and s:0's reply of before is not kept
    zero = r.xadd("s:0", {"k": "0"})
    assert sorted(_read_until(reads, r, positions, want=2)) == [("s:0", zero), ("s:1", first)]
    assert _read_until(reads, r, positions, want=1, timeout=0.5) == []  # nothing twice


def test_a_failed_read_raises_on_the_callers_thread(reads):
    dead = redis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0))
    with pytest.raises(redis.ConnectionError):
        reads.read(dead, dict.fromkeys(STREAMS, b"0-0"), block_ms=1000)


def test_a_group_is_one_xread_of_its_streams(server, r):
    reads = StreamReads([STREAMS], count=10)
    try:
        positions = dict.fromkeys(STREAMS, b"0-0")
        ids = {s: r.xadd(s, {"k": s}) for s in ("s:0", "s:2")}
        assert sorted(_read_until(reads, r, positions, want=2)) == sorted(ids.items())
    finally:
        reads.close()
