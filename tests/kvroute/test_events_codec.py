"""KV event codec (kvroute.events): every event type survives encode_batch/decode_batch unchanged."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.events import (
    CPU,
    GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventDecodeError,
    decode_batch,
    encode_batch,
)
from kvroute.v1 import events_pb2

U64 = 2**64 - 1


def roundtrip(events, ts=1700000000.25):
    got_ts, got = decode_batch(encode_batch(events, ts))
    assert got_ts == ts
    return got


def test_block_stored_roundtrips_with_parent_and_tokens():
    ev = BlockStored(
        block_hashes=(1, U64), parent_block_hash=7, token_ids=(1, 2, 3, 4, 5, 6, 7, 8), block_size=4
    )
    assert roundtrip([ev]) == [ev]


def test_parent_none_and_parent_zero_stay_distinct():
    none = BlockStored((5,), None, (1, 2), 2)
    zero = BlockStored((5,), 0, (1, 2), 2)
    assert roundtrip([none, zero]) == [none, zero]
    assert roundtrip([zero])[0].parent_block_hash == 0
    assert roundtrip([none])[0].parent_block_hash is None


def test_block_stored_with_extra_keys_lora_and_cpu_medium():
    extras = (
        (("lora", "adapter", "/models/a"), ("mm", "img-1", -3), ("cache_salt", "s")),
        None,
        (("lora", "adapter", "/models/a"), ("mm", "img-2", 2)),
    )
    ev = BlockStored((1, 2, 3), 9, tuple(range(6)), 2, lora_name="adapter", medium=CPU, extra_keys=extras)
    assert roundtrip([ev]) == [ev]


def test_block_stored_all_none_extra_keys_per_block():
    ev = BlockStored((1, 2), None, (1, 2, 3, 4), 2, extra_keys=(None, None))
    assert roundtrip([ev]) == [ev]


def test_cpu_tier_block_stored_without_tokens_roundtrips():
    ev = BlockStored((123,), None, (), 0, None, CPU, None)
    assert roundtrip([ev]) == [ev]


@pytest.mark.parametrize("medium", [GPU, CPU])
def test_block_removed_roundtrips(medium):
    ev = BlockRemoved((0, 1, U64, 1), medium=medium)
    assert roundtrip([ev]) == [ev]


@pytest.mark.parametrize("medium", [None, GPU, CPU])
def test_all_blocks_cleared_roundtrips(medium):
    assert roundtrip([AllBlocksCleared(medium)]) == [AllBlocksCleared(medium)]


def test_batch_keeps_event_order_and_empty_batch():
    events = [
        BlockRemoved((3,)),
        BlockStored((4, 5), 2, (1, 2, 3, 4), 2),
        AllBlocksCleared(),
        BlockRemoved((4,), CPU),
    ]
    assert roundtrip(events) == events
    assert roundtrip([]) == []


@pytest.mark.parametrize(
    "data",
    [b"\xff\xff\xff\xff", b"\x12\x05\x0a\x03", b"\x09\x00", b"\x0a" + b"\xff" * 12],
    ids=["bad-varint", "truncated-submessage", "truncated-double", "overlong-length"],
)
def test_garbage_bytes_raise_event_decode_error(data):
    with pytest.raises(EventDecodeError):
        decode_batch(data)


def test_event_with_nothing_set_raises_event_decode_error():
    batch = events_pb2.KVEventBatch(ts=1.0)
    batch.events.add()  # a KVEvent with no oneof member
    with pytest.raises(EventDecodeError, match="no event"):
        decode_batch(batch.SerializeToString())


def test_extra_key_with_nothing_set_raises_event_decode_error():
    batch = events_pb2.KVEventBatch(ts=1.0)
    stored = batch.events.add().block_stored
    stored.block_hashes.append(1)
    stored.extra_keys.add().keys.add()  # an ExtraKey with no key set
    with pytest.raises(EventDecodeError, match="extra_keys"):
        decode_batch(batch.SerializeToString())


def test_encode_rejects_non_events_and_unknown_extra_tags():
    with pytest.raises(TypeError):
        encode_batch(["not an event"], 0.0)
    with pytest.raises(ValueError, match="unknown tag"):
        encode_batch([BlockStored((1,), None, (1,), 1, extra_keys=((("bogus", 1),),))], 0.0)


# -- random events --------------------------------------------------------------------------------

_text = st.text(max_size=8)
_extra = st.none() | st.lists(
    st.one_of(
        st.tuples(st.just("lora"), st.text(min_size=1, max_size=8), _text),
        st.tuples(st.just("mm"), _text, st.integers(-(2**63), 2**63 - 1)),
        st.tuples(st.just("cache_salt"), _text),
    ),
    min_size=1,
    max_size=3,
).map(tuple)


@st.composite
def block_stored(draw):
    n = draw(st.integers(0, 4))
    block_size = draw(st.integers(0, 8))
    extras = draw(st.none() | st.lists(_extra, min_size=n, max_size=n).map(tuple))
    if extras is not None and not extras:
        extras = None  # an empty tuple is encoded as "no extra keys"
    return BlockStored(
        block_hashes=tuple(draw(st.lists(st.integers(0, U64), min_size=n, max_size=n))),
        parent_block_hash=draw(st.none() | st.integers(0, U64)),
        token_ids=tuple(draw(st.lists(st.integers(0, 2**32 - 1), max_size=n * block_size))),
        block_size=block_size,
        lora_name=draw(st.none() | st.text(min_size=1, max_size=8)),
        medium=draw(st.sampled_from([GPU, CPU])),
        extra_keys=extras,
    )


_events = st.one_of(
    block_stored(),
    st.builds(
        BlockRemoved, st.lists(st.integers(0, U64), max_size=4).map(tuple), st.sampled_from([GPU, CPU])
    ),
    st.builds(AllBlocksCleared, st.sampled_from([None, GPU, CPU])),
)


@settings(max_examples=200, deadline=None)
@given(events=st.lists(_events, max_size=6), ts=st.floats(allow_nan=False, allow_infinity=False))
def test_random_batches_roundtrip(events, ts):
    assert roundtrip(events, ts) == events
