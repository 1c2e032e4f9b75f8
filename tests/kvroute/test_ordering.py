"""The event-ordering rules (kvroute/ordering.py, DESIGN.md §4, §5): ReplicaStream's decisions on
hand-worked sequences, and ReplicaCacheState, the multiset a reader rebuilds with them. No Redis.

In the sequences, an entry's batch is the string ``"b<seq>"`` so that what is handed out to apply
reads as the seqs it carries."""

from __future__ import annotations

from collections import Counter

from kvroute.events import CPU, GPU, AllBlocksCleared, BlockRemoved, BlockStored
from kvroute.ordering import BatchResult, Decision, ReplicaCacheState, ReplicaStream
from kvroute.snapshot import CacheSnapshot

E = 1_700_000_000_000_000_000  # an epoch (the publisher's time_ns at start)
APPLIED, STALE, GAP = BatchResult.APPLIED, BatchResult.STALE, BatchResult.GAP


def b(seq: int) -> str:
    return f"b{seq}"


def stream_at(seq: int, epoch: int = E) -> ReplicaStream[str]:
    """A stream that has applied entries 1..seq of ``epoch`` in order."""
    st: ReplicaStream[str] = ReplicaStream(epoch)
    for s in range(1, seq + 1):
        assert st.offer(epoch, s, b(s)) == Decision(APPLIED, False, (b(s),))
    return st


# -- ReplicaStream: entries ---------------------------------------------------------------------------
def test_in_order_entries_are_applied_one_by_one():
    st = stream_at(3)
    assert (st.epoch, st.seq, st.in_gap, st.gaps_opened) == (E, 3, False, 0)


def test_a_reorder_is_held_until_the_hole_fills_then_applied_in_seq_order():
    st = stream_at(2)
    assert st.offer(E, 4, b(4)) == Decision(GAP)  # 3 is missing: held
    assert st.offer(E, 5, b(5)) == Decision(GAP)
    assert (st.seq, st.num_pending, st.in_gap) == (2, 2, True)
    assert st.offer(E, 3, b(3)) == Decision(APPLIED, False, (b(3), b(4), b(5)))  # the hole fills
    assert (st.seq, st.num_pending, st.in_gap, st.gaps_opened) == (5, 0, False, 1)


def test_a_duplicate_is_ignored_and_never_applied_twice():
    st = stream_at(3)
    assert st.is_stale(E, 2) and st.is_stale(E, 3) and not st.is_stale(E, 4)
    assert st.offer(E, 2, b(2)) == Decision(STALE)  # e.g. the publisher's retry after an ambiguous EXEC
    assert st.offer(E, 3, b(3)) == Decision(STALE)
    assert st.offer(E, 4, b(4)) == Decision(APPLIED, False, (b(4),))


def test_a_new_epoch_drops_the_replica_and_an_older_epoch_is_ignored():
    st = stream_at(5)
    e2 = E + 10
    assert st.offer(e2, 1, b(1)) == Decision(APPLIED, True, (b(1),))  # drop what is known, then apply
    assert (st.epoch, st.seq) == (e2, 1)
    assert st.is_stale(E, 6)
    assert st.offer(E, 6, b(6)) == Decision(STALE)  # a late entry of the old epoch
    assert st.seq == 1


def test_a_new_epoch_seen_from_its_middle_drops_the_replica_and_waits_for_a_snapshot():
    st = stream_at(5)
    e2 = E + 10
    assert st.offer(e2, 4, b(4)) == Decision(GAP, True)
    assert (st.epoch, st.seq, st.in_gap) == (e2, 0, True)
    assert not st.covers(e2, 2) and st.covers(e2, 3)  # the hole is 1..3
    assert st.load_snapshot(e2, 3) == (b(4),)
    assert (st.seq, st.in_gap) == (4, False)


def test_a_heartbeat_of_a_new_epoch_restarts_the_position():
    st = stream_at(5)
    st.offer(E, 7, b(7))
    assert not st.start_epoch(E) and not st.start_epoch(E - 1)
    assert st.start_epoch(E + 1)
    assert (st.epoch, st.seq, st.num_pending, st.in_gap) == (E + 1, 0, 0, False)


def test_a_stream_that_knows_nothing_takes_the_first_epoch_as_new():
    st: ReplicaStream[str] = ReplicaStream()
    assert not st.is_stale(E, 1)
    assert st.offer(E, 1, b(1)) == Decision(APPLIED, True, (b(1),))


# -- ReplicaStream: gaps and snapshots -----------------------------------------------------------------
def test_a_snapshot_at_or_after_the_hole_resolves_the_gap_and_only_later_held_entries_apply():
    st = stream_at(2)
    for s in (5, 6, 7):  # 3 and 4 are lost
        assert st.offer(E, s, b(s)) == Decision(GAP)
    assert [st.covers(E, s) for s in (2, 3, 4, 5, 6)] == [False, False, True, True, True]
    assert st.load_snapshot(E, 5) == (b(6), b(7))  # 5 is in the snapshot: only 6 and 7 are applied
    assert (st.seq, st.num_pending, st.in_gap) == (7, 0, False)


def test_a_snapshot_before_the_hole_does_not_resolve_the_gap():
    st = stream_at(2)
    st.offer(E, 5, b(5))
    assert not st.covers(E, 3)  # 4 is still missing after it
    assert st.load_snapshot(E, 3) == ()  # loaded anyway (a bootstrap): the gap stays open
    assert (st.seq, st.in_gap) == (3, True)
    assert st.offer(E, 4, b(4)) == Decision(APPLIED, False, (b(4), b(5)))
    assert not st.in_gap


def test_a_snapshot_of_a_newer_epoch_always_covers_and_an_older_one_never():
    st = stream_at(2)
    st.offer(E, 9, b(9))
    assert st.covers(E + 1, 1) and not st.covers(E - 1, 100)
    assert st.load_snapshot(E + 1, 1) == ()  # held entries of the old epoch are dropped
    assert (st.epoch, st.seq, st.in_gap) == (E + 1, 1, False)


def test_an_unreadable_entry_is_lost_and_only_a_snapshot_at_or_after_it_closes_the_gap():
    st = stream_at(1)
    assert st.lost(E, 2) == Decision(GAP)
    assert (st.floor, st.in_gap) == (2, True)
    assert st.offer(E, 3, b(3)) == Decision(GAP)
    assert not st.covers(E, 1) and st.covers(E, 2)
    assert st.load_snapshot(E, 2) == (b(3),)
    assert (st.seq, st.in_gap) == (3, False)
    assert st.lost(E, 3) == Decision(STALE)


def test_a_full_pending_buffer_is_given_up_and_the_seq_becomes_the_floor():
    st: ReplicaStream[str] = ReplicaStream(E, max_pending=2)
    st.offer(E, 1, b(1))
    st.offer(E, 3, b(3))
    st.offer(E, 4, b(4))
    assert st.offer(E, 5, b(5)) == Decision(GAP)  # full: 3 and 4 given up, 5 not held
    assert (st.num_pending, st.floor) == (0, 5)
    assert st.offer(E, 2, b(2)) == Decision(APPLIED, False, (b(2),))
    assert st.in_gap and not st.covers(E, 4) and st.covers(E, 5)


def test_each_gap_is_counted_once_when_it_opens():
    st = stream_at(1)
    st.offer(E, 3, b(3))
    st.offer(E, 4, b(4))
    assert st.gaps_opened == 1
    st.offer(E, 2, b(2))
    st.offer(E, 6, b(6))
    assert st.gaps_opened == 2


# -- ReplicaStream: stalls ---------------------------------------------------------------------------------
def test_a_replica_ahead_with_no_progress_for_two_checks_is_a_stall_gap():
    st = stream_at(3)
    assert not st.check_stall(E, 5, None, caught_up=True)  # first sight: maybe the entries are on their way
    assert st.check_stall(E, 5, None, caught_up=True)  # still at 3: the tail is lost
    assert (st.floor, st.in_gap) == (5, True)
    assert not st.covers(E, 4) and st.covers(E, 5)
    assert not st.check_stall(E, 5, None, caught_up=True)  # already in the gap


def test_progress_between_checks_or_a_reader_behind_is_no_stall():
    st = stream_at(3)
    assert not st.check_stall(E, 5, None, caught_up=True)
    st.offer(E, 4, b(4))
    assert not st.check_stall(E, 5, None, caught_up=True)  # progress: start over
    assert not st.check_stall(E, 5, None, caught_up=False)
    assert not st.check_stall(E, 5, None, caught_up=True)  # not caught up in between: start over
    assert not st.in_gap


def test_the_snapshot_seq_counts_as_the_replica_position_for_a_stall():
    st = stream_at(3)
    # The publisher dropped batches 4-6: no entry, no heartbeat progress, but a snapshot at 6.
    assert not st.check_stall(E, 3, (E, 6), caught_up=True)
    assert st.check_stall(E, 3, (E, 6), caught_up=True)
    assert st.floor == 6
    other = stream_at(3)
    for _ in range(3):  # a heartbeat and a snapshot of another epoch say nothing about this one
        assert not other.check_stall(E + 1, 9, (E + 1, 9), caught_up=True)


# -- ReplicaCacheState -------------------------------------------------------------------------------------
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
    snap = CacheSnapshot(replica_id="r", epoch=1, seq=7, media={GPU: [5, 5, 6], CPU: [8]})
    s.load_snapshot(snap)
    assert s.as_multiset() == {GPU: Counter({5: 2, 6: 1}), CPU: Counter({8: 1})}
    assert (s.epoch, s.seq) == (1, 7)
    assert s.apply_batch(1, 7, [stored(99)]) is BatchResult.STALE
    assert s.apply_batch(1, 8, [removed(5)]) is BatchResult.APPLIED
    assert s.as_multiset()[GPU] == Counter({5: 1, 6: 1})


def test_entries_held_in_a_gap_are_applied_after_the_snapshot_that_covers_it():
    s = ReplicaCacheState()
    s.apply_batch(1, 1, [stored(1)])
    assert s.apply_batch(1, 4, [stored(4)]) is BatchResult.GAP  # 2 and 3 lost
    assert s.apply_batch(1, 5, [removed(2)]) is BatchResult.GAP
    s.load_snapshot(CacheSnapshot(replica_id="r", epoch=1, seq=4, media={GPU: [1, 2, 3, 4]}))
    assert (s.seq, s.in_gap) == (5, False)  # 4 is in the snapshot; 5 was applied after it
    assert s.as_multiset()[GPU] == Counter({1: 1, 3: 1, 4: 1})
    assert s.apply_batch(1, 5, [removed(2)]) is BatchResult.STALE
