"""IndexFeed against hostile stream input (router/consumer_feed.py, "Hostile input"): each kind of
malformed entry is rejected under its reason, counted, logged once per replica and reason, and a
healthy replica's entries next to it are applied as if nothing happened. No Redis."""

from __future__ import annotations

import logging

import pytest

from kvroute.events import (
    CPU,
    GPU,
    MAX_BATCH_BYTES,
    MAX_EVENT_HASHES,
    BlockRemoved,
    BlockStored,
    encode_batch,
)
from kvroute.v1 import events_pb2
from tests.router.test_consumer_feed import CLEAR, E, gpu, make_feed, stored


def _batch(*events: events_pb2.KVEvent) -> bytes:
    return events_pb2.KVEventBatch(ts=0.0, events=events).SerializeToString()


def _stored_pb(n_hashes: int, block_size: int = 16, n_tokens: int = 0, medium: str = GPU) -> events_pb2.KVEvent:
    ev = events_pb2.KVEvent()
    ev.block_stored.block_hashes.extend(range(1, n_hashes + 1))
    ev.block_stored.block_size = block_size
    ev.block_stored.token_ids.extend([1] * n_tokens)
    ev.block_stored.medium = medium
    return ev


def _removed_pb(n_hashes: int) -> events_pb2.KVEvent:
    ev = events_pb2.KVEvent()
    ev.block_removed.block_hashes.extend(range(1, n_hashes + 1))
    return ev


HOSTILE = {
    "undecodable": b"\x0a\xff\xff\xff\xff\x0f",  # a length-delimited field longer than the bytes
    "wrong protobuf": b"\x12\x03\xff\xff\xff",  # field 2 (events) holding bytes that are no KVEvent
    "absurd hash count": _batch(_removed_pb(MAX_EVENT_HASHES + 1)),
    "absurd block size": _batch(_stored_pb(2, block_size=1 << 30)),
    "more tokens than blocks hold": _batch(_stored_pb(1, n_tokens=17)),
}
REASON = {"undecodable": "undecodable", "wrong protobuf": "undecodable", "absurd hash count": "hash_count",
          "absurd block size": "block_size", "more tokens than blocks hold": "hash_count"}


@pytest.mark.parametrize("kind", list(HOSTILE))
def test_a_hostile_batch_is_rejected_as_lost_and_the_healthy_replica_goes_on(kind, caplog):
    data = HOSTILE[kind]
    feed = make_feed()
    feed.entry("h", E, 1, stored(1, 2), history=False)
    feed.entry("evil", E, 1, CLEAR, history=False)
    with caplog.at_level(logging.WARNING, logger="router.consumer"):
        for seq in (2, 3):
            feed.entry("evil", E, seq, data, history=False)
    feed.entry("h", E, 2, stored(3), history=False)
    reason = REASON[kind]
    assert feed.rejected[reason] == 2 and feed.bad_entries == 2
    assert sum(feed.rejected.values()) == 2
    assert caplog.text.count(f"evil: rejected ({reason})") == 1  # logged once
    assert gpu(feed, "h") == {1: 1, 2: 1, 3: 1} and gpu(feed, "evil") == {}
    assert feed.any_gap and feed.gaps_due(0.0) == ["evil"]  # the snapshot resyncs it


def test_an_oversized_entry_is_rejected_before_parsing():
    feed = make_feed()
    feed.entry("r", E, 1, b"\x00" * (MAX_BATCH_BYTES + 1), history=False)
    assert feed.rejected["too_large"] == 1 and gpu(feed) == {}


def test_an_event_of_an_unknown_medium_is_skipped_and_the_rest_of_its_batch_applies(caplog):
    feed = make_feed()
    data = encode_batch([BlockStored((1,), None, (), 16, None, "NVME", None), BlockStored((2,), None, (), 16),
                         BlockRemoved((2,), "TAPE"), BlockStored((3,), None, (), 0, None, CPU, None)], ts=0.0)
    with caplog.at_level(logging.WARNING, logger="router.consumer"):
        feed.entry("r", E, 1, data, history=False)
        feed.entry("r", E, 2, data, history=False)
    assert gpu(feed) == {2: 2} and feed.index.cached_set("r", CPU) == {3: 2}
    assert feed.rejected["medium"] == 4 and feed.bad_entries == 0 and not feed.any_gap
    assert caplog.text.count("r: rejected (medium)") == 1


def test_seq_going_backwards_is_stale_not_applied():
    feed = make_feed()
    for seq, data in ((1, stored(1)), (2, stored(2)), (1, stored(9)), (0, stored(8))):
        feed.entry("r", E, seq, data, history=False)
    assert gpu(feed) == {1: 1, 2: 1} and feed.stale_batches == 2 and not feed.any_gap
