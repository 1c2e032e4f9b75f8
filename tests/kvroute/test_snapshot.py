"""The CacheSnapshot codec and its head reader (kvroute/snapshot.py, DESIGN.md §4)."""

from __future__ import annotations

import time

import pytest

from kvroute.events import CPU, GPU, EventDecodeError
from kvroute.snapshot import (
    SNAPSHOT_HEAD_BYTES,
    CacheSnapshot,
    decode_snapshot,
    encode_snapshot,
    snapshot_position,
)
from kvroute.v1 import events_pb2


def test_a_snapshot_round_trips_with_one_hash_per_copy():
    snap = CacheSnapshot("replica-a", epoch=time.time_ns(), seq=42, ts=1.5, media={GPU: [5, 5, 2**64 - 1], CPU: [8]})
    assert decode_snapshot(encode_snapshot(snap)) == snap


def test_the_wire_bytes_are_the_proto_message():
    snap = CacheSnapshot("replica-a", epoch=7, seq=3, ts=2.0, media={GPU: [1, 2]})
    msg = events_pb2.CacheSnapshot.FromString(encode_snapshot(snap))
    assert (msg.replica_id, msg.epoch, msg.seq, msg.ts) == ("replica-a", 7, 3, 2.0)
    assert [(m.medium, list(m.block_hashes)) for m in msg.media] == [(GPU, [1, 2])]


def test_decode_reads_an_unnamed_medium_as_gpu_and_joins_a_repeated_one():
    msg = events_pb2.CacheSnapshot(replica_id="r", epoch=1, seq=2)
    msg.media.add(medium="", block_hashes=[1])
    msg.media.add(medium=GPU, block_hashes=[2])
    msg.media.add(medium=CPU, block_hashes=[3])
    assert decode_snapshot(msg.SerializeToString()).media == {GPU: [1, 2], CPU: [3]}


def test_decode_of_bytes_that_are_no_snapshot_raises():
    with pytest.raises(EventDecodeError, match="CacheSnapshot"):
        decode_snapshot(b"\xff\xff\xff")


def test_snapshot_position_reads_epoch_and_seq_from_the_first_bytes():
    snap = CacheSnapshot("replica-" + "x" * 60, epoch=time.time_ns(), seq=300, ts=1.5, media={GPU: range(1, 10000)})
    data = encode_snapshot(snap)
    assert snapshot_position(data[:128]) == (snap.epoch, 300)
    assert snapshot_position(data[:20]) is None  # truncated before the seq
    assert snapshot_position(b"") is None and snapshot_position(None) is None


def test_every_truncated_head_gives_none_until_the_seq_is_in_it_then_the_position():
    snap = CacheSnapshot("replica-7", epoch=1_700_000_000_123_456_789, seq=123_456, ts=3.25, media={GPU: [9] * 50})
    data = encode_snapshot(snap)
    end_of_seq = len(events_pb2.CacheSnapshot(replica_id="replica-7", epoch=snap.epoch, seq=snap.seq).SerializeToString())
    assert [snapshot_position(data[:n]) for n in range(end_of_seq)] == [None] * end_of_seq
    for n in range(end_of_seq, SNAPSHOT_HEAD_BYTES + 1):
        assert snapshot_position(data[:n]) == (snap.epoch, snap.seq)
    assert snapshot_position(data) == (snap.epoch, snap.seq)


def test_a_replica_id_too_long_for_the_head_gives_none():
    data = encode_snapshot(CacheSnapshot("r" * SNAPSHOT_HEAD_BYTES, epoch=5, seq=6))
    assert snapshot_position(data[:SNAPSHOT_HEAD_BYTES]) is None
    assert snapshot_position(data) == (5, 6)


def test_a_head_that_is_no_snapshot_gives_none_without_raising():
    assert snapshot_position(b"\x07garbage") is None  # wire type 7 does not exist
    assert snapshot_position(b"\xff" * 20) is None  # a varint that never ends
