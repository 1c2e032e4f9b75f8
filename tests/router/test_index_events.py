"""router.index.decode_events, the compiled reader of the KV event batches replicas write, against
protobuf (upb) + kvroute.events.batch_problem, the path it stands in for (router.consumer_feed):
for any bytes it either declines (None: the caller parses them with protobuf) or gives exactly what
that path would apply, and it takes the form replicas write."""

from __future__ import annotations

import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import router.index
from kvroute.events import MAX_EVENT_HASHES, BlockRemoved, BlockStored, batch_problem, encode_batch
from kvroute.v1 import events_pb2
from router.consumer_feed import events_of
from router.index import decode_events
from tests.kvroute.test_events_fuzz import events
from tests.router.test_index import STORAGES, new_index

pytestmark = pytest.mark.skipif(router.index._index is None, reason="router._index not built")
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def as_lists(batch):
    ts, evs = batch
    return ts, [(which, medium, list(hashes)) for which, medium, hashes in evs]


def through_protobuf(data: bytes, block_size: int):
    """What router.consumer_feed applies of ``data`` without the compiled reader (None: lost)."""
    try:
        message = events_pb2.KVEventBatch.FromString(data)
    except Exception:
        return None
    if batch_problem(message, block_size) is not None:
        return None
    return as_lists(events_of(message))


def agree(data: bytes, block_size: int = 16) -> bool:
    """decode_events declines or agrees with protobuf; True when it took the bytes."""
    fast = decode_events(data, block_size)
    if fast is None:
        return False
    assert as_lists(fast) == through_protobuf(data, block_size)
    return True


def key(field: int, wire_type: int) -> bytes:
    return varint(field << 3 | wire_type)


def varint(v: int) -> bytes:
    out = bytearray()
    while True:
        b, v = v & 0x7F, v >> 7
        out.append(b | (0x80 if v else 0))
        if not v:
            return bytes(out)


def field(number: int, body: bytes) -> bytes:
    return key(number, 2) + varint(len(body)) + body


@FUZZ
@given(events, st.floats(allow_nan=False), st.sampled_from([16, 4]))
def test_the_batches_replicas_write_are_read_as_protobuf_reads_them(evs, ts, block_size):
    data = encode_batch(evs, ts)
    taken = agree(data, block_size)
    assert taken == (through_protobuf(data, block_size) is not None)  # none of them is declined


@FUZZ
@given(events, st.data())
def test_truncated_corrupted_or_extended_batches_are_declined_or_read_alike(evs, data):
    raw = bytearray(encode_batch(evs, 1.0))
    if raw and data.draw(st.booleans()):
        raw = raw[: data.draw(st.integers(0, len(raw)))]
    for _ in range(data.draw(st.integers(0, 3))):
        if raw:
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    raw += data.draw(st.binary(max_size=8))
    agree(bytes(raw), data.draw(st.sampled_from([16, 1])))


@FUZZ
@given(st.binary(max_size=200))
def test_any_bytes_are_declined_or_read_alike(data):
    agree(data)


def test_forms_replicas_do_not_write_are_declined_and_protobuf_decides():
    hashes = field(1, varint(7) + varint(8))  # BlockStored.block_hashes, packed
    stored = field(2, field(1, hashes + field(6, b"GPU")))  # KVEventBatch.events[0].block_stored
    assert as_lists(decode_events(stored, 16)) == (0.0, [("block_stored", "GPU", [7, 8])])
    declined = {
        "unpacked hashes": field(2, field(1, key(1, 0) + varint(7) + key(1, 0) + varint(8))),
        "two fields of the oneof": field(2, field(1, hashes) + field(2, hashes)),
        "an unknown field": stored + field(9, b"x"),
        "an unknown field in an event": field(2, field(1, hashes + key(15, 0) + varint(1))),
        "a medium that is not UTF-8": field(2, field(2, hashes + field(2, b"\xff"))),
        "a surrogate in a LoRA name": field(2, field(1, hashes + field(5, b"\xed\xa0\x80"))),
        "a truncated event": stored[:-2],
        "a 10-byte varint past 64 bits": field(2, field(2, field(1, b"\xff" * 9 + b"\x7f"))),
        "too many token ids": field(2, field(1, hashes + key(4, 0) + varint(16) + field(3, varint(1) * 33))),
        "another block size": field(2, field(1, hashes + key(4, 0) + varint(32))),
    }
    for what, data in declined.items():
        assert decode_events(data, 16) is None, what
    assert through_protobuf(declined["unpacked hashes"], 16) == (0.0, [("block_stored", "", [7, 8])])
    assert through_protobuf(declined["a medium that is not UTF-8"], 16) is None  # upb refuses it
    ts = key(1, 1) + struct.pack("<d", 2.5)
    assert agree(ts + stored + ts) and decode_events(stored + field(2, b""), 16)[1][1] == (None, "", ())


def test_hash_counts_past_the_bound_are_declined_to_be_reported():
    data = encode_batch([BlockRemoved(tuple(range(MAX_EVENT_HASHES + 1)), "GPU")], 1.0)
    assert decode_events(data, 16) is None and through_protobuf(data, 16) is None
    ok = encode_batch([BlockStored((1, 2), None, tuple(range(32)), 16)], 1.0)
    assert agree(ok) and not agree(encode_batch([BlockStored((1, 2), None, tuple(range(33)), 16)], 1.0))


def test_the_hashes_it_gives_are_read_by_both_storages():
    _, [(_, _, hashes)] = decode_events(encode_batch([BlockStored((5, 2**64 - 1), None, (), 16)], 0.0), 16)
    assert len(hashes) == 2 and list(hashes) == [5, 2**64 - 1] and hashes[1] == 2**64 - 1
    assert memoryview(hashes).format == "Q" and memoryview(hashes).tolist() == [5, 2**64 - 1]
    with pytest.raises(IndexError):
        hashes[2]
    for name in STORAGES:
        index = new_index(name)
        index.add("a", hashes)
        index.add("a", [5])
        assert index.cached_set("a") == {5: 2, 2**64 - 1: 1} and index.remove("a", hashes) == 0
