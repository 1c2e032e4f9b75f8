"""Fuzzing the consumer's apply path with hypothesis: hostile stream entries (any replica id
bytes, epoch, seq and batch bytes; valid batches cut or corrupted) interleaved with a healthy
replica's entries, through EventConsumer._handle_entry (the field checks) into IndexFeed. Nothing
raises, every hostile entry is applied or rejected under a known reason, and the healthy replica's
index is exactly its cached set (kvroute.ordering.ReplicaCacheState of the same events)."""

from __future__ import annotations

import threading

from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.events import GPU, BlockRemoved, BlockStored, encode_batch
from kvroute.hashing import BlockHasher
from kvroute.ordering import ReplicaCacheState
from kvroute.redis_layout import F_BATCH, F_EPOCH, F_REPLICA_ID, F_SEQ, RedisLayout
from router.consumer import EventConsumer
from router.consumer_feed import REJECT_REASONS
from router.index import BlockIndex
from router.registry import ReplicaRegistry
from tests.router.test_consumer_feed import E

LAYOUT = RedisLayout(namespace="fuzz")
STREAM = LAYOUT.events_stream("h")

valid_batch = st.lists(st.one_of(
    st.builds(lambda hs: BlockStored(tuple(hs), None, (), 16), st.lists(st.integers(0, 2**64 - 1), max_size=4)),
    st.builds(lambda hs: BlockRemoved(tuple(hs), GPU), st.lists(st.integers(0, 2**64 - 1), max_size=4)),
), max_size=3).map(lambda evs: encode_batch(evs, 1.0))


@st.composite
def hostile_fields(draw):
    """A stream entry's fields as redis-py returns them (bytes -> bytes), some missing or garbage."""
    rid = draw(st.one_of(st.sampled_from([b"h", b"evil", b"", b"\xff\xfe", "é".encode()]), st.binary(max_size=8)))
    num = st.one_of(st.integers(-3, 5).map(lambda i: str(E + i if i > 0 else i).encode()),
                    st.sampled_from([b"", b"x", b"1e3", str(2**64).encode(), b"\xff"]))
    data = st.one_of(valid_batch, st.binary(max_size=48),
                     valid_batch.flatmap(lambda b: st.integers(0, len(b)).map(lambda n: b[:n])))
    fields = {F_REPLICA_ID: rid, F_EPOCH: draw(num), F_SEQ: draw(st.integers(0, 6).map(lambda i: str(i).encode())),
              F_BATCH: draw(data)}
    for key in draw(st.sets(st.sampled_from(list(fields)), max_size=1)):
        del fields[key]
    return fields


def _consumer() -> EventConsumer:
    # Never started: no Redis is needed to hand it entries.
    return EventConsumer("redis://127.0.0.1:1/0", LAYOUT, BlockIndex(speculative_ttl=0),
                         ReplicaRegistry(BlockHasher().identity, "redis"), index_lock=threading.Lock())


@settings(max_examples=100, deadline=None)
@given(st.lists(hostile_fields(), max_size=12), st.lists(st.lists(st.integers(1, 50), min_size=1, max_size=3),
                                                         min_size=1, max_size=6))
def test_hostile_entries_never_raise_nor_disturb_a_healthy_replica(hostile, healthy_steps):
    consumer = _consumer()
    truth = ReplicaCacheState()
    healthy = []
    for seq, hs in enumerate(healthy_steps, start=1):
        events = [BlockStored(tuple(hs), None, (), 16)]
        truth.apply_batch(E + 7, seq, events)
        healthy.append({F_REPLICA_ID: b"h-ok", F_EPOCH: str(E + 7).encode(), F_SEQ: str(seq).encode(),
                        F_BATCH: encode_batch(events, 1.0)})
    entries = [e for pair in zip(hostile, healthy, strict=False) for e in pair]
    entries += hostile[len(healthy):] + healthy[len(hostile):]
    for i, fields in enumerate(entries):
        consumer._handle_entry(STREAM, f"{i + 1}-0".encode(), fields, None)
    assert set(consumer.rejected) == set(REJECT_REASONS)
    assert consumer.rejected["error"] == 0
    with consumer.index_lock:
        assert consumer.index.cached_set("h-ok", GPU) == dict(truth.as_multiset()[GPU])
