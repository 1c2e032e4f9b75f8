"""Fuzzing the KV event and snapshot codecs (kvroute/events.py, kvroute/snapshot.py) with
hypothesis: any bytes decode or raise EventDecodeError (nothing else), encoded events round-trip,
and snapshot_position never raises. Bounded: ``FUZZ`` examples each."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvroute.events import (
    MEDIA,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventDecodeError,
    batch_problem,
    decode_batch,
    encode_batch,
    parse_message,
)
from kvroute.snapshot import CacheSnapshot, decode_snapshot, encode_snapshot, snapshot_position
from kvroute.v1 import events_pb2

FUZZ = settings(max_examples=150, deadline=None)
u64 = st.integers(0, 2**64 - 1)
hashes = st.lists(u64, max_size=8).map(tuple)
text = st.text(max_size=12)
extra = st.one_of(
    st.none(),
    st.lists(st.one_of(
        st.tuples(st.just("lora"), text, text),
        st.tuples(st.just("mm"), text, st.integers(-2**63, 2**63 - 1)),
        st.tuples(st.just("cache_salt"), text),
    ), min_size=1, max_size=3).map(tuple),
)


@st.composite
def stored(draw):
    hs = draw(hashes)
    block_size = draw(st.integers(0, 64))
    return BlockStored(
        block_hashes=hs, parent_block_hash=draw(st.none() | u64),
        token_ids=tuple(draw(st.lists(st.integers(0, 2**32 - 1), max_size=len(hs) * block_size))),
        block_size=block_size, lora_name=draw(st.none() | st.text(min_size=1, max_size=8)),
        medium=draw(st.sampled_from(MEDIA)),
        # one per block hash, or None (no hashes: None, which is what an empty list decodes as)
        extra_keys=draw(st.none() | st.lists(extra, min_size=len(hs), max_size=len(hs)).map(tuple)) if hs else None,
    )


events = st.lists(st.one_of(
    stored(),
    st.builds(BlockRemoved, hashes, st.sampled_from(MEDIA)),
    st.builds(AllBlocksCleared, st.none() | st.sampled_from(MEDIA)),
), max_size=6)


def _decode_or_refuse(fn, data):
    try:
        return fn(data)
    except EventDecodeError:
        return None


@FUZZ
@given(events, st.floats(allow_nan=False))
def test_encoded_events_round_trip(evs, ts):
    assert decode_batch(encode_batch(evs, ts)) == (ts, evs)


@FUZZ
@given(st.binary(max_size=256))
def test_any_bytes_decode_or_raise_event_decode_error(data):
    decoded = _decode_or_refuse(decode_batch, data)
    if decoded is not None:
        assert isinstance(decoded[1], list)
    batch = _decode_or_refuse(lambda d: parse_message(events_pb2.KVEventBatch, d), data)
    if batch is not None:  # what the router's feed checks before applying: a reason or None
        problem = batch_problem(batch, 16)
        assert problem is None or problem[0] in ("hash_count", "block_size")


@FUZZ
@given(events, st.data())
def test_truncated_or_corrupted_batches_decode_or_raise_event_decode_error(evs, data):
    raw = bytearray(encode_batch(evs, 1.0))
    if raw:
        cut = data.draw(st.integers(0, len(raw)))
        raw = raw[:cut]
    for _ in range(data.draw(st.integers(0, 3))):
        if raw:
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    _decode_or_refuse(decode_batch, bytes(raw))


@FUZZ
@given(st.binary(max_size=256))
def test_any_bytes_are_a_snapshot_or_event_decode_error_and_position_never_raises(data):
    snap = _decode_or_refuse(decode_snapshot, data)
    assert snap is None or isinstance(snap, CacheSnapshot)
    pos = snapshot_position(data)
    assert pos is None or (len(pos) == 2 and all(isinstance(v, int) and v >= 0 for v in pos))


@FUZZ
@given(st.text(max_size=40), st.integers(1, 2**64 - 1), st.integers(1, 2**64 - 1), st.dictionaries(st.sampled_from(MEDIA), st.lists(u64, max_size=5)))
def test_a_snapshot_round_trips_and_its_head_gives_its_position(rid, epoch, seq, media):
    snap = CacheSnapshot(rid, epoch, seq, 1.5, media)
    data = encode_snapshot(snap)
    assert decode_snapshot(data) == CacheSnapshot(rid, epoch, seq, 1.5, {m: list(h) for m, h in media.items()})
    if len(rid.encode()) <= 100:  # the head holds the position (kvroute.snapshot; 0 is not written)
        assert snapshot_position(data[:128]) == (epoch, seq)
