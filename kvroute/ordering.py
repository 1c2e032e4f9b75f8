"""The event-ordering rules: what a reader of one replica's event stream does with each entry
(DESIGN.md §4, §5). Pure: no I/O, no clock. The router's consumer drives :class:`ReplicaStream`
with what it reads from Redis and applies its decisions to the index; :class:`ReplicaCacheState`
(tests, the simulator) drives the same class and applies them to a multiset. One rule set.

    stream entry (epoch, seq, batch) ──offer / lost─────────────▶ ┌───────────────┐ ──▶ Decision: new epoch?,
    heartbeat (epoch, last_seq)      ──start_epoch / check_stall▶ │ ReplicaStream │     batches to apply
    snapshot at (epoch, seq)         ──covers / load_snapshot───▶ └───────────────┘ ──▶ held batches after it

The rules, for one replica (its position: every batch up to ``seq`` of ``epoch`` is applied):
- An entry of an older epoch, or at or below ``seq`` of this epoch (a duplicate, a publisher
  retry, history a snapshot already covers), is **stale**: ignored.
- A newer epoch means the replica restarted: everything applied is void (``Decision.new_epoch``:
  drop what is known of it), the position becomes (epoch, 0). The epoch's seq 1 is
  ``AllBlocksCleared`` alone.
- The next seq is applied, then every held entry that now follows, in seq order: a **reorder**
  fills its hole and nothing else happens.
- A later seq is held (up to ``max_pending`` entries; past that they are given up and the seq is
  the floor below). An entry that cannot be read is **lost**: entries up to its seq can only come
  back through a snapshot, so ``floor`` rises to it.
- The replica is **in a gap** while entries are held or ``seq < floor``. A snapshot resolves the
  gap when it is valid at or after the hole (:meth:`ReplicaStream.covers`: a newer epoch, or this
  epoch at ``seq >= max(floor, first held - 1)``); loading it moves the position to the snapshot's
  and applies only the held entries after its seq. A snapshot before the hole does not.
- A **stall** is a gap too: the replica is known to be past the position (its heartbeat's
  ``last_seq``, or its snapshot's seq: batches the publisher dropped leave no entry) and two checks
  in a row saw no progress while the reader was caught up (entries lost at the stream's tail).
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from kvroute.events import CPU, GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvroute.snapshot import CacheSnapshot

T = TypeVar("T")

MAX_PENDING = 10000
"""Entries held per replica while a gap is open (a reader's memory bound)."""


class BatchResult(enum.Enum):
    """What became of one stream entry."""

    APPLIED = "applied"  # applied, with any held entries that follow it
    STALE = "stale"  # a duplicate, already applied, or an older epoch: ignored
    GAP = "gap"  # held or lost: not applied, a gap is open


@dataclass(frozen=True, slots=True)
class Decision(Generic[T]):
    """What the reader must do for one entry, in this order: if ``new_epoch``, drop everything
    known of the replica; then apply ``apply`` (batches, in seq order)."""

    result: BatchResult
    new_epoch: bool = False
    apply: tuple[T, ...] = ()


_STALE: Decision = Decision(BatchResult.STALE)


class ReplicaStream(Generic[T]):
    """Where one replica's stream has been applied up to, and the entries held while a gap is open.

    ``T`` is whatever the reader applies (a decoded ``KVEventBatch``, a list of events); this class
    only holds and returns them. Invariant: every batch up to ``seq`` of ``epoch`` has been handed
    out to apply, exactly once and in order; held entries are all of ``epoch`` and after
    ``seq + 1``; ``in_gap`` iff an entry is held or ``seq < floor``.

    Args:
        epoch: the epoch the reader starts in; None when nothing is known (the first entry's epoch
            is then a new epoch).
        max_pending: entries held at most while a gap is open.
    """

    __slots__ = ("epoch", "seq", "floor", "gaps_opened", "max_pending", "_pending", "_stall_seq")

    def __init__(self, epoch: int | None = None, *, max_pending: int = MAX_PENDING):
        self.max_pending = max_pending
        self.gaps_opened = 0  # gaps opened since this state was made: a reader paces its checks by it
        self._reset(epoch)

    def _reset(self, epoch: int | None) -> None:
        self.epoch = epoch
        self.seq = 0
        self.floor = 0  # entries up to here are known lost: only a snapshot at or after it resyncs
        self._pending: dict[int, T] = {}
        self._stall_seq: int | None = None  # seq seen behind the replica's at the last stall check

    @property
    def in_gap(self) -> bool:
        """Batches are missing after ``seq``: held entries wait for them, or a snapshot is needed."""
        return bool(self._pending) or self.seq < self.floor

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    # -- entries -----------------------------------------------------------------------------------
    def is_stale(self, epoch: int, seq: int) -> bool:
        """Whether entry ``seq`` of ``epoch`` would be ignored (a reader may skip decoding it)."""
        return self.epoch is not None and (epoch < self.epoch or (epoch == self.epoch and seq <= self.seq))

    def offer(self, epoch: int, seq: int, batch: T) -> Decision[T]:
        """Entry ``seq`` of ``epoch`` carrying ``batch``: apply it (and what it unblocks), hold it, or ignore it."""
        if self.is_stale(epoch, seq):
            return _STALE
        new_epoch = self.start_epoch(epoch)
        if seq == self.seq + 1:
            self.seq = seq
            if not self._pending:
                return Decision(BatchResult.APPLIED, new_epoch, (batch,))
            return Decision(BatchResult.APPLIED, new_epoch, (batch, *self._drain()))
        was_in_gap = self.in_gap
        if len(self._pending) >= self.max_pending:
            # Too far behind to buffer: give the entries up and wait for a snapshot at or after them.
            self._pending.clear()
            self.floor = max(self.floor, seq)
        else:
            self._pending[seq] = batch
        self._count_gap(was_in_gap)
        return Decision(BatchResult.GAP, new_epoch)

    def lost(self, epoch: int, seq: int) -> Decision[T]:
        """Entry ``seq`` of ``epoch`` exists but cannot be read: it is never applied, and only a
        snapshot at or after it closes the gap it opens."""
        if self.is_stale(epoch, seq):
            return _STALE
        new_epoch = self.start_epoch(epoch)
        was_in_gap = self.in_gap
        self.floor = max(self.floor, seq)
        self._count_gap(was_in_gap)
        return Decision(BatchResult.GAP, new_epoch)

    def start_epoch(self, epoch: int) -> bool:
        """The replica is in ``epoch`` (an entry or its heartbeat says so). True when that is a new
        epoch: the position restarts at (epoch, 0) and the reader must drop what it knows of it."""
        if self.epoch is not None and epoch <= self.epoch:
            return False
        self._reset(epoch)
        return True

    def _drain(self) -> tuple[T, ...]:
        """Forget held entries at or below ``seq``; hand out those that now follow it, in order."""
        pending = self._pending
        for s in [s for s in pending if s <= self.seq]:
            del pending[s]
        out = []
        while (batch := pending.pop(self.seq + 1, None)) is not None:
            out.append(batch)
            self.seq += 1
        return tuple(out)

    def _count_gap(self, was_in_gap: bool) -> None:
        if not was_in_gap and self.in_gap:
            self.gaps_opened += 1

    # -- snapshots ---------------------------------------------------------------------------------
    def covers(self, epoch: int, seq: int) -> bool:
        """Whether a snapshot valid at (``epoch``, ``seq``) closes the open gap: a newer epoch, or
        this epoch at or after the hole (``seq >= max(floor, first held - 1)``) and past ``seq``."""
        if self.epoch is None or epoch > self.epoch:
            return True
        need = max(self.floor, min(self._pending) - 1 if self._pending else 0)
        return epoch == self.epoch and seq >= need and seq > self.seq

    def load_snapshot(self, epoch: int, seq: int) -> tuple[T, ...]:
        """The reader replaced what it knows of the replica with a snapshot valid at (``epoch``,
        ``seq``): that is the position now. Returns the held entries after it, to apply next."""
        if epoch != self.epoch:
            self._reset(epoch)
        self.seq = seq
        return self._drain()

    # -- heartbeats --------------------------------------------------------------------------------
    def check_stall(self, epoch: int, last_seq: int, snapshot_at: tuple[int, int] | None, caught_up: bool) -> bool:
        """One stall check (every heartbeat poll): the replica says it is in ``epoch`` with
        ``last_seq`` written, its snapshot is at ``snapshot_at`` (if known); ``caught_up``: the
        reader has read the streams to their end. True when this check opens a gap (``floor`` is
        then the seq the replica is known to be at)."""
        target = last_seq if epoch == self.epoch else 0
        if snapshot_at is not None and snapshot_at[0] == self.epoch:
            target = max(target, snapshot_at[1])
        if target > self.seq and not self.in_gap and caught_up:
            if self._stall_seq == self.seq:
                self.floor = target
                self._count_gap(False)
                return True
            self._stall_seq = self.seq
        else:
            self._stall_seq = None
        return False


class ReplicaCacheState:
    """One replica's cached hashes, per medium, with a reference count per copy, rebuilt from its
    events by the rules above (kvroute.ordering's ``ReplicaStream``).

    Owns ``medium -> Counter[event hash]`` and its stream position (``epoch``, ``seq``; None / 0
    before the first batch or snapshot). Invariant: every count is >= 1 (a hash whose count reaches
    0 is deleted), so ``as_multiset()`` compares equal to the replica's ``cached_event_hashes()``
    taken at the same seq.

    Contract of the set: a **multiset per medium**: a replica may cache the same hash in two blocks
    (block tables are append-only, so cached blocks are not de-duplicated), and every copy is
    announced by its own BlockStored and dropped by its own BlockRemoved; a count per (medium, hash)
    is what lets one copy's removal leave the other visible. ``BlockStored`` adds 1 per hash,
    ``BlockRemoved`` takes 1 and never goes below 0 (a removal of an absent hash is an anomaly,
    counted in ``num_missing_removals``), ``AllBlocksCleared`` empties its medium, or every medium
    when ``medium`` is None.
    """

    def __init__(self) -> None:
        self._media: dict[str, Counter[int]] = {GPU: Counter(), CPU: Counter()}
        self._stream: ReplicaStream[Sequence[KVCacheEvent]] = ReplicaStream()
        self.num_missing_removals = 0

    @property
    def epoch(self) -> int | None:
        return self._stream.epoch

    @property
    def seq(self) -> int:
        return self._stream.seq

    # -- events ------------------------------------------------------------------------------------
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
        """Stream entry ``seq`` of ``epoch`` by the ordering rules: APPLIED (with the held entries
        it unblocks), STALE (ignored) or GAP (held or lost; :meth:`load_snapshot` resolves it)."""
        decision = self._stream.offer(epoch, seq, tuple(events))
        if decision.new_epoch:
            self.clear()
        for batch in decision.apply:
            self.apply_events(batch)
        return decision.result

    @property
    def in_gap(self) -> bool:
        return self._stream.in_gap

    # -- snapshots ---------------------------------------------------------------------------------
    def load_snapshot(self, snapshot: CacheSnapshot) -> None:
        """Replace the whole state with ``snapshot`` (valid right after its ``seq``), then apply
        the held entries after it."""
        after = self._stream.load_snapshot(snapshot.epoch, snapshot.seq)
        self.clear()
        for medium, hashes in snapshot.media.items():
            self._media.setdefault(medium, Counter()).update(hashes)
        for batch in after:
            self.apply_events(batch)

    def clear(self) -> None:
        """Forget every hash (the position is kept)."""
        for counts in self._media.values():
            counts.clear()

    def as_multiset(self) -> dict[str, Counter[int]]:
        """A copy of the state: ``medium -> Counter(event hash -> copies)``, GPU and CPU always present."""
        return {medium: Counter(counts) for medium, counts in self._media.items()}


__all__ = ["MAX_PENDING", "BatchResult", "Decision", "ReplicaCacheState", "ReplicaStream"]
