"""ReplicaCacheState: the multiset a reader rebuilds from a replica's events (kvroute/cache_state.py)."""

from __future__ import annotations

from collections import Counter

from kvroute.cache_state import BatchResult, ReplicaCacheState
from kvroute.events import CPU, GPU, AllBlocksCleared, BlockRemoved, BlockStored
from kvroute.v1 import events_pb2


def stored(*hashes: int, medium: str = GPU) -> BlockStored:
    return BlockStored(tuple(hashes), None, (), 16, None, medium, None)


def removed(*hashes: int, medium: str = GPU) -> BlockRemoved:
    return BlockRemoved(tuple(hashes), medium)


def test_removing_one_copy_of_a_duplicate_keeps_the_other():
    s = ReplicaCacheState()
    s.apply_events([stored(1, 2), stored(1)])
    s.apply(removed(1))
    assert s.as_multiset() == {GPU: Counter({1: 1, 2: 1}), CPU: Counter()}
    s.apply(removed(1))
    assert s.as_multiset()[GPU] == Counter({2: 1})
    assert 1 not in s.as_multiset()[GPU]


def test_removal_of_an_absent_hash_never_goes_below_zero_and_is_counted():
    s = ReplicaCacheState()
    s.apply(removed(7))
    s.apply(stored(7, medium=CPU))
    s.apply(removed(7))  # GPU: absent there
    assert s.num_missing_removals == 2
    assert s.as_multiset() == {GPU: Counter(), CPU: Counter({7: 1})}


def test_all_blocks_cleared_drops_one_medium_or_all():
    s = ReplicaCacheState()
    s.apply_events([stored(1, 2), stored(3, medium=CPU)])
    s.apply(AllBlocksCleared(medium=GPU))
    assert s.as_multiset() == {GPU: Counter(), CPU: Counter({3: 1})}
    s.apply_events([stored(4), AllBlocksCleared(medium=None)])
    assert s.as_multiset() == {GPU: Counter(), CPU: Counter()}


def test_as_multiset_is_a_copy():
    s = ReplicaCacheState()
    s.apply(stored(1))
    s.as_multiset()[GPU][1] += 5
    assert s.as_multiset()[GPU] == Counter({1: 1})


def test_apply_batch_applies_in_order_ignores_replays_and_reports_gaps():
    s = ReplicaCacheState()
    assert s.apply_batch(10, 1, [AllBlocksCleared()]) is BatchResult.APPLIED
    assert s.apply_batch(10, 2, [stored(1)]) is BatchResult.APPLIED
    assert s.apply_batch(10, 2, [stored(1)]) is BatchResult.STALE  # a duplicate after a publisher retry
    assert s.apply_batch(10, 4, [stored(9)]) is BatchResult.GAP
    assert (s.epoch, s.seq) == (10, 2)
    assert s.as_multiset()[GPU] == Counter({1: 1})


def test_a_new_epoch_drops_what_was_known_and_an_older_one_is_ignored():
    s = ReplicaCacheState()
    s.apply_batch(10, 1, [stored(1)])
    assert s.apply_batch(20, 1, [AllBlocksCleared(), stored(2)]) is BatchResult.APPLIED
    assert s.as_multiset()[GPU] == Counter({2: 1})
    assert s.apply_batch(10, 2, [stored(3)]) is BatchResult.STALE
    # A new epoch seen from the middle: nothing known, and the caller must load the snapshot.
    assert s.apply_batch(30, 5, [stored(4)]) is BatchResult.GAP
    assert s.as_multiset()[GPU] == Counter()


def test_load_snapshot_replaces_the_state_and_sets_the_position():
    s = ReplicaCacheState()
    s.apply_batch(1, 1, [stored(1, 2, 3)])
    snap = events_pb2.CacheSnapshot(replica_id="r", epoch=1, seq=7)
    snap.media.add(medium=GPU, block_hashes=[5, 5, 6])
    snap.media.add(medium=CPU, block_hashes=[8])
    s.load_snapshot(snap)
    assert s.as_multiset() == {GPU: Counter({5: 2, 6: 1}), CPU: Counter({8: 1})}
    assert (s.epoch, s.seq) == (1, 7)
    assert s.apply_batch(1, 7, [stored(99)]) is BatchResult.STALE
    assert s.apply_batch(1, 8, [removed(5)]) is BatchResult.APPLIED
    assert s.as_multiset()[GPU] == Counter({5: 1, 6: 1})
