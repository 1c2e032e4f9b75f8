"""IndexFeed: the consumer's entries, heartbeats and snapshots through kvroute.ordering into the
BlockIndex, and the pacing of open gaps (router/consumer_feed.py). No Redis: the tests hand it
what the consumer thread would have read."""

from __future__ import annotations

import threading

from kvroute.events import CPU, GPU, AllBlocksCleared, BlockRemoved, BlockStored, encode_batch
from kvroute.hashing import BlockHasher
from kvroute.heartbeat import Heartbeat
from kvroute.snapshot import CacheSnapshot
from router.consumer_feed import REQUEST_EVERY_S, SNAPSHOT_POLL_S, IndexFeed
from router.index import BlockIndex
from router.registry import ReplicaRegistry

E = 1_700_000_000_000_000_000
ROUTER = BlockHasher().identity


def stored(*hashes: int, medium: str = GPU) -> bytes:
    return encode_batch([BlockStored(tuple(hashes), None, (), 16, None, medium, None)], ts=0.0)


def removed(*hashes: int, medium: str = GPU) -> bytes:
    return encode_batch([BlockRemoved(tuple(hashes), medium)], ts=0.0)


CLEAR = encode_batch([AllBlocksCleared(None)], ts=0.0)


def make_feed() -> IndexFeed:
    return IndexFeed(BlockIndex(speculative_ttl=0), ReplicaRegistry(ROUTER, "redis"), threading.Lock())


def heartbeat(feed: IndexFeed, rid: str = "r", epoch: int = E, last_seq: int = 0, **fields):
    """Record a heartbeat of ``rid`` in the feed's registry; the ReplicaInfo."""
    algorithm, digest, block_size = ROUTER
    fields = {"hash_algorithm": algorithm, "hash_seed_digest": digest, "block_size": block_size, **fields}
    beat = Heartbeat(replica_id=rid, address="10.0.0.1:1", epoch=epoch, last_seq=last_seq, **fields)
    return feed.registry.update_from_heartbeat(beat, now=0.0)


def gpu(feed: IndexFeed, rid: str = "r") -> dict[int, int]:
    return feed.index.cached_set(rid, GPU)


def test_entries_in_order_are_applied_with_their_whole_hash_lists():
    feed = make_feed()
    feed.entry("r", E, 1, CLEAR, history=False)
    feed.entry("r", E, 2, stored(1, 2, 2), history=False)
    feed.entry("r", E, 3, removed(2), history=False)
    feed.entry("r", E, 4, stored(7, medium=CPU), history=False)
    assert gpu(feed) == {1: 1, 2: 1} and feed.index.cached_set("r", CPU) == {7: 1}
    assert (feed.batches_applied, feed.events_applied, feed.blocks_applied) == (4, 4, 5)
    assert feed.replicas() == ["r"]


def test_a_reorder_is_applied_in_seq_order_and_never_counted_as_a_gap():
    feed = make_feed()
    feed.entry("r", E, 1, stored(1), history=False)
    feed.entry("r", E, 3, removed(2), history=False)  # before 2: held
    assert gpu(feed) == {1: 1} and feed.any_gap
    feed.entry("r", E, 2, stored(2), history=False)
    assert gpu(feed) == {1: 1} and not feed.any_gap
    assert feed.gaps_due(now=0.0) == [] and feed.gaps == 0


def test_duplicates_and_old_epochs_are_stale_except_in_a_bootstrap_backlog():
    feed = make_feed()
    feed.entry("r", E + 1, 1, stored(1), history=False)
    feed.entry("r", E + 1, 1, stored(1), history=False)  # a duplicate
    feed.entry("r", E, 9, stored(9), history=False)  # an older epoch
    feed.entry("r", E + 1, 1, stored(1), history=True)  # covered history read by a bootstrap
    assert gpu(feed) == {1: 1} and feed.stale_batches == 2


def test_a_new_epoch_drops_the_replica_entries_first():
    feed = make_feed()
    feed.entry("r", E, 1, stored(1, 2), history=False)
    feed.entry("r", E + 1, 1, stored(3), history=False)
    assert gpu(feed) == {3: 1} and feed.epoch_changes == 1


def test_entries_of_unknown_replicas_in_the_backlog_and_of_unroutable_ones_are_ignored():
    feed = make_feed()
    feed.entry("gone", E, 1, stored(1), history=True)  # history of a replica with no heartbeat
    heartbeat(feed, "bad", block_size=32)  # a hash triple the router refuses
    feed.entry("bad", E, 1, stored(1), history=False)
    assert feed.replicas() == [] and feed.index.replicas == []


def test_entries_of_an_expired_replica_are_not_followed_again_until_a_later_epoch():
    feed = make_feed()
    heartbeat(feed, "r")
    feed.entry("r", E, 1, stored(1), history=False)
    feed.registry.expire("r")
    feed.expire("r", E)  # what the consumer does when the heartbeat key is gone
    feed.entry("r", E, 5, stored(5), history=False)  # a late entry of the dead instance: seq 2-4 never come
    assert feed.replicas() == [] and feed.index.replicas == []
    assert not feed.any_gap and feed.gaps_due(now=0.0) == [] and feed.gaps == 0
    assert not feed.request_due("r", now=0.0) and feed.snapshot_requests == 0
    assert feed.stale_batches == 1
    feed.entry("r", E + 1, 1, CLEAR, history=False)  # the replica restarted: a new epoch is followed
    feed.entry("r", E + 1, 2, stored(2), history=False)
    assert gpu(feed) == {2: 1} and feed.replicas() == ["r"]


def test_an_expired_replica_that_heartbeats_again_is_followed_again():
    feed = make_feed()
    feed.entry("r", E, 1, stored(1), history=False)  # entries before any heartbeat: followed
    feed.expire("r")  # the epoch it was followed at
    feed.entry("r", E, 2, stored(2), history=False)
    assert feed.replicas() == []
    feed.heartbeat(heartbeat(feed, "r", last_seq=2), None, caught_up=True)  # it was only late
    feed.entry("r", E, 3, stored(3), history=False)
    assert feed.replicas() == ["r"]


def test_an_undecodable_batch_is_a_lost_entry_that_opens_a_gap():
    feed = make_feed()
    feed.entry("r", E, 1, stored(1), history=False)
    feed.entry("r", E, 2, b"\xff\xff\xff", history=False)
    feed.entry("r", E, 3, stored(3), history=False)
    assert feed.bad_entries == 1 and gpu(feed) == {1: 1} and feed.any_gap
    assert not feed.covers("r", (E, 1)) and feed.covers("r", (E, 2))


def test_each_gap_is_counted_once_and_checked_every_poll_interval():
    feed = make_feed()
    feed.entry("r", E, 1, stored(1), history=False)
    feed.entry("r", E, 3, stored(3), history=False)
    assert feed.gaps_due(now=10.0) == ["r"] and feed.gaps == 1
    assert feed.gaps_due(now=10.0 + SNAPSHOT_POLL_S / 2) == []
    assert feed.gaps_due(now=10.0 + SNAPSHOT_POLL_S) == ["r"] and feed.gaps == 1


def test_a_covering_snapshot_resyncs_and_only_later_held_entries_apply():
    feed = make_feed()
    feed.entry("r", E, 1, stored(1), history=False)
    feed.entry("r", E, 4, stored(4), history=False)  # 2, 3 lost
    feed.entry("r", E, 5, removed(1), history=False)
    assert not feed.resync("r", CacheSnapshot("r", E, 2, media={GPU: [1, 2]}))  # before the hole
    assert feed.resync("r", CacheSnapshot("r", E, 4, media={GPU: [1, 2, 3, 4], CPU: [9], "NVME": [8]}))
    assert gpu(feed) == {2: 1, 3: 1, 4: 1} and feed.index.cached_set("r", CPU) == {9: 1}
    assert feed.resyncs == 1 and not feed.any_gap


def test_snapshot_requests_go_out_once_a_second_per_epoch_while_the_gap_is_open():
    feed = make_feed()
    feed.entry("r", E, 1, stored(1), history=False)
    feed.entry("r", E, 3, stored(3), history=False)
    assert feed.request_due("r", now=5.0)
    assert not feed.request_due("r", now=5.0 + REQUEST_EVERY_S / 2)
    assert feed.request_due("r", now=5.0 + REQUEST_EVERY_S)
    feed.entry("r", E + 1, 2, stored(2), history=False)  # a new epoch, seen from its middle
    assert feed.request_due("r", now=5.0 + REQUEST_EVERY_S)  # at once, not a second later
    assert feed.snapshot_requests == 3
    feed.entry("r", E + 1, 1, CLEAR, history=False)
    assert not feed.request_due("r", now=100.0)  # the gap closed


def test_a_heartbeat_notices_a_new_epoch_and_a_stall():
    feed = make_feed()
    feed.entry("r", E, 1, stored(1), history=False)
    info = heartbeat(feed, last_seq=3)
    feed.heartbeat(info, None, caught_up=True)
    feed.heartbeat(info, None, caught_up=True)  # no progress across a whole poll: a stall gap
    assert feed.gaps_due(now=0.0) == ["r"] and feed.covers("r", (E, 3)) and not feed.covers("r", (E, 2))
    feed.heartbeat(heartbeat(feed, epoch=E + 1), None, caught_up=True)
    assert gpu(feed) == {} and feed.epoch_changes == 1 and not feed.any_gap


def test_a_bootstrap_loads_a_snapshot_newer_than_what_is_known():
    feed = make_feed()
    info = heartbeat(feed)
    feed.bootstrap(info, CacheSnapshot("r", E, 5, media={GPU: [1]}))
    feed.entry("r", E, 5, stored(5), history=True)  # covered by the snapshot
    feed.entry("r", E, 6, stored(6), history=True)
    assert gpu(feed) == {1: 1, 6: 1} and feed.stale_batches == 0
    feed.bootstrap(info, CacheSnapshot("r", E, 5, media={GPU: [99]}))  # not newer: kept as is
    assert gpu(feed) == {1: 1, 6: 1}
    feed.bootstrap(heartbeat(feed, "q"), None)  # no snapshot: followed from its epoch
    assert sorted(feed.replicas()) == ["q", "r"]
