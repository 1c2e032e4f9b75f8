"""ReplicaCacheState: one replica's cached block set, rebuilt from its KV events (DESIGN.md §4, §5).

A pure data structure (no I/O): whoever reads the event stream (the router's consumer, tests,
the simulator) feeds it what it reads and asks for the result.

    stream entry (epoch, seq, KVEventBatch) ──apply_batch──▶ ┌──────────────────────────────┐
    CacheSnapshot (epoch, seq, media)       ──load_snapshot─▶│ medium -> Counter[event hash] │──▶ as_multiset()
                                                              └──────────────────────────────┘
Contract:
- The set is a **multiset per medium**: a replica may cache the same hash in two blocks (block
  tables are append-only, so cached blocks are not de-duplicated), and every copy is announced by
  its own BlockStored and dropped by its own BlockRemoved. Keeping a reference count per
  (medium, hash) is what lets one copy's removal leave the other copy visible.
- ``BlockStored`` adds 1 per hash, ``BlockRemoved`` takes 1 per hash and never goes below 0 (a
  removal of an absent hash is an anomaly, counted in ``num_missing_removals``),
  ``AllBlocksCleared`` empties its medium, or every medium when ``medium`` is None.
- ``apply_batch`` follows the stream's ordering rules: within an epoch ``seq`` grows by one per
  batch; a larger epoch means the replica restarted, so everything known of it is dropped; entries
  at or below the current seq (replays, duplicates after a publisher retry) and entries of older
  epochs are ignored; a seq gap is reported and nothing is applied: the caller then loads the
  snapshot and replays the entries after its seq.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterable

from kvroute.events import CPU, GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvroute.v1 import events_pb2


class BatchResult(enum.Enum):
    """What ``ReplicaCacheState.apply_batch`` did with one stream entry."""

    APPLIED = "applied"
    STALE = "stale"  # seq already applied, or an older epoch: ignored
    GAP = "gap"  # batches are missing before this one: not applied, load the snapshot


class ReplicaCacheState:
    """The cached hashes of one replica, per medium, with a reference count per copy.

    Owns ``medium -> Counter[event hash]`` and the position it is valid at (``epoch``, ``seq``;
    None / 0 before the first batch or snapshot). Invariant: every count is >= 1 (a hash whose
    count reaches 0 is deleted), so ``as_multiset()`` compares equal to the replica's
    ``cached_event_hashes()`` taken at the same seq.
    """

    def __init__(self) -> None:
        self._media: dict[str, Counter[int]] = {GPU: Counter(), CPU: Counter()}
        self.epoch: int | None = None
        self.seq = 0
        self.num_missing_removals = 0

    # -- events ------------------------------------------------------------------------------
    def apply(self, event: KVCacheEvent) -> None:
        """Apply one event (no ordering checks)."""
        if isinstance(event, BlockStored):
            counts = self._media.setdefault(event.medium, Counter())
            for h in event.block_hashes:
                counts[h] += 1
        elif isinstance(event, BlockRemoved):
            counts = self._media.setdefault(event.medium, Counter())
            for h in event.block_hashes:
                n = counts.get(h, 0)
                if n <= 0:
                    self.num_missing_removals += 1
                elif n == 1:
                    del counts[h]
                else:
                    counts[h] = n - 1
        elif isinstance(event, AllBlocksCleared):
            for medium, counts in self._media.items():
                if event.medium is None or medium == event.medium:
                    counts.clear()
        else:
            raise TypeError(f"not a KV cache event: {event!r}")

    def apply_events(self, events: Iterable[KVCacheEvent]) -> None:
        """Apply events in order (no ordering checks)."""
        for event in events:
            self.apply(event)

    def apply_batch(self, epoch: int, seq: int, events: Iterable[KVCacheEvent]) -> BatchResult:
        """Apply one stream entry if it is the next one; see the module docstring for the rules."""
        if self.epoch is None or epoch > self.epoch:
            # A new epoch: the replica restarted and what we knew of it is void.
            self.clear()
            self.epoch, self.seq = epoch, 0
        elif epoch < self.epoch:
            return BatchResult.STALE
        if seq <= self.seq:
            return BatchResult.STALE
        if seq != self.seq + 1:
            return BatchResult.GAP
        self.apply_events(events)
        self.seq = seq
        return BatchResult.APPLIED

    # -- snapshots -----------------------------------------------------------------------------
    def load_snapshot(self, snapshot: events_pb2.CacheSnapshot) -> None:
        """Replace the whole state with ``snapshot`` (valid right after its ``seq``)."""
        self.clear()
        for medium in snapshot.media:
            self._media.setdefault(medium.medium or GPU, Counter()).update(medium.block_hashes)
        self.epoch, self.seq = snapshot.epoch, snapshot.seq

    def clear(self) -> None:
        """Forget every hash (the position is kept)."""
        for counts in self._media.values():
            counts.clear()

    def as_multiset(self) -> dict[str, Counter[int]]:
        """A copy of the state: ``medium -> Counter(event hash -> copies)``, GPU and CPU always present."""
        return {medium: Counter(counts) for medium, counts in self._media.items()}


__all__ = ["BatchResult", "ReplicaCacheState"]
