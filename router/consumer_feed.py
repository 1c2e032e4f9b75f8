"""IndexFeed: what the event consumer read from Redis, through the ordering rules into the index
(DESIGN.md §4, §5). No I/O: router/consumer.py's thread reads, this module decides and writes
the BlockIndex.

    stream entry (rid, epoch, seq, bytes) ──entry──▶ ┌────────────────────────────────┐
    heartbeat (ReplicaInfo, snapshot pos) ──heartbeat▶│ per replica: kvroute.ordering  │──▶ BlockIndex
    CacheSnapshot                         ──resync / │   ReplicaStream + gap pacing    │   (index_lock)
                                           bootstrap▶└────────────────────────────────┘
                       gaps_due(now) / covers / request_due ──▶ the consumer: GETRANGE, GET, PUBLISH

Decisions are applied as the rules give them: a new epoch -> ``index.clear_replica``; each batch
to apply -> BlockStored ``index.add``, BlockRemoved ``index.remove``, AllBlocksCleared
``index.clear_replica``, each with the event's whole hash list; a snapshot -> ``index.load``,
then the held batches after it. An undecodable batch is a lost entry (kvroute.ordering).

Gap pacing (the consumer's side of a gap): each open gap's snapshot key is checked every
``SNAPSHOT_POLL_S`` (at once when the gap opens), and a snapshot request is published at most
every ``REQUEST_EVERY_S`` per replica and epoch.

Single-threaded: only the consumer thread calls it. Counters (``events_applied``, ...) are
plain ints, read from any thread; :class:`router.consumer.EventConsumer` documents them.
"""

from __future__ import annotations

import logging
import threading
import time

from kvroute.events import GPU, MEDIA, EventDecodeError, parse_message
from kvroute.ordering import Decision, ReplicaStream
from kvroute.snapshot import CacheSnapshot
from kvroute.v1 import events_pb2
from router.index import BlockIndex
from router.registry import ReplicaInfo, ReplicaRegistry

log = logging.getLogger("router.consumer")  # one logger for the consumer, whichever half logs

SNAPSHOT_POLL_S = 0.05  # how often an open gap re-reads the snapshot key
REQUEST_EVERY_S = 1.0  # how often an open gap re-publishes its snapshot request
MAX_GONE = 4096  # expired replicas remembered (their late entries are ignored)

Batch = events_pb2.KVEventBatch


class _Replica:
    """One replica's ordering state and the pacing of its open gap."""

    __slots__ = ("stream", "gap_seen", "next_check", "request_epoch", "last_request")

    def __init__(self, epoch: int):
        self.stream: ReplicaStream[Batch] = ReplicaStream(epoch)
        self.gap_seen = 0  # the stream's gaps_opened when its latest gap was counted
        self.next_check = 0.0
        self.request_epoch: int | None = None  # the epoch of the last snapshot request
        self.last_request = 0.0


class IndexFeed:
    """Keeps ``index`` equal to the replicas' cached sets, from entries, heartbeats and snapshots.

    Owns ``replica_id -> (kvroute.ordering.ReplicaStream, gap pacing)``. Invariant: the index
    holds, for each replica here, its cached set as of its stream's position; a replica not here
    has no entries but those of a speculative credit. Every index call is under ``index_lock``.

    Args:
        index: the index to write.
        registry: read for whether a replica whose entries arrive is routable.
        index_lock: the lock shared with the index's readers.
    """

    COUNTERS = ("events_applied", "blocks_applied", "batches_applied", "stale_batches", "gaps", "resyncs",
                "snapshot_requests", "epoch_changes", "bad_entries", "stream_lag_seconds")

    def __init__(self, index: BlockIndex, registry: ReplicaRegistry, index_lock: threading.Lock):
        self.index = index
        self.registry = registry
        self.index_lock = index_lock
        self._replicas: dict[str, _Replica] = {}
        self._gone: dict[str, int] = {}  # expired replica -> its last epoch (insertion order: oldest first)
        self.events_applied = 0
        self.blocks_applied = 0
        self.batches_applied = 0
        self.stale_batches = 0
        self.gaps = 0
        self.resyncs = 0
        self.snapshot_requests = 0
        self.epoch_changes = 0
        self.bad_entries = 0
        self.stream_lag_seconds = 0.0

    # -- replicas ----------------------------------------------------------------------------------------
    def replicas(self) -> list[str]:
        """The replicas followed now."""
        return list(self._replicas)

    def drop(self, rid: str) -> None:
        """Stop following ``rid`` and drop its index entries (expired, or not routable)."""
        self._replicas.pop(rid, None)
        with self.index_lock:
            self.index.remove_replica(rid)

    def expire(self, rid: str, epoch: int | None = None) -> None:
        """``rid``'s heartbeat is gone (``epoch``: its last heartbeat's, if known): :meth:`drop` it,
        and ignore its entries of that epoch or older (stale) until it heartbeats again or starts a
        later epoch. Its snapshot key has no TTL: re-following a dead replica from a late entry
        would re-index that snapshot, count a gap and publish snapshot requests for nobody."""
        rep = self._replicas.get(rid)
        known = [e for e in (epoch, rep.stream.epoch if rep is not None else None) if e is not None]
        self._gone[rid] = max(known, default=-1)
        while len(self._gone) > MAX_GONE:  # ids that never come back: forget the oldest
            del self._gone[next(iter(self._gone))]
        self.drop(rid)

    def _follow(self, rid: str, epoch: int) -> _Replica:
        self._gone.pop(rid, None)
        rep = self._replicas[rid] = _Replica(epoch)
        return rep

    # -- entries -----------------------------------------------------------------------------------------
    def entry(self, rid: str, epoch: int, seq: int, data: bytes, *, history: bool) -> None:
        """One stream entry of ``rid``; ``history``: read by a bootstrap from before it started
        (what the snapshot loaded already covers is not counted as stale)."""
        rep = self._replicas.get(rid)
        if rep is None:
            info = self.registry.get(rid)
            if info is not None and not info.routable:
                return
            if info is None and history:
                return  # history of a replica that was gone before this bootstrap
            if info is None and epoch <= self._gone.get(rid, epoch - 1):
                self.stale_batches += 1  # a late entry of an expired replica
                return
            rep = self._follow(rid, epoch)
        stream = rep.stream
        if stream.is_stale(epoch, seq):  # checked first: a stale entry is not worth decoding
            if not history:
                self.stale_batches += 1
            return
        try:
            batch = parse_message(Batch, data)
        except EventDecodeError as e:
            log.warning("kv consumer: %s seq %d: undecodable batch (%s)", rid, seq, e)
            self.bad_entries += 1
            self._act(rid, stream.lost(epoch, seq))
            return
        self._act(rid, stream.offer(epoch, seq, batch))

    def _act(self, rid: str, decision: Decision[Batch]) -> None:
        if decision.new_epoch:
            self._drop_epoch(rid)
        for batch in decision.apply:
            self._apply(rid, batch)

    def _drop_epoch(self, rid: str) -> None:
        log.info("kv consumer: %s: new epoch %d; dropping its entries", rid, self._replicas[rid].stream.epoch)
        with self.index_lock:
            self.index.clear_replica(rid)
        self.epoch_changes += 1

    def _apply(self, rid: str, batch: Batch) -> None:
        """Apply one decoded batch to the index."""
        index = self.index
        blocks = 0
        # One index call per event with its whole hash list: the per-hash loop lives in the index.
        with self.index_lock:
            for ev in batch.events:
                which = ev.WhichOneof("event")
                if which == "block_stored":
                    s = ev.block_stored
                    if (medium := s.medium or GPU) in MEDIA:
                        index.add(rid, s.block_hashes, medium)
                        blocks += len(s.block_hashes)
                elif which == "block_removed":
                    r = ev.block_removed
                    if (medium := r.medium or GPU) in MEDIA:
                        index.remove(rid, r.block_hashes, medium)
                        blocks += len(r.block_hashes)
                elif which == "all_blocks_cleared":
                    medium = ev.all_blocks_cleared.medium or None
                    if medium is None or medium in MEDIA:
                        index.clear_replica(rid, medium)
        self.events_applied += len(batch.events)
        self.blocks_applied += blocks
        self.batches_applied += 1
        self.stream_lag_seconds = max(0.0, time.time() - batch.ts)

    # -- heartbeats and snapshots ------------------------------------------------------------------------
    def bootstrap(self, info: ReplicaInfo, snap: CacheSnapshot | None) -> None:
        """A routable replica found by a bootstrap: load ``snap`` (its snapshot) if it is of the
        heartbeat's epoch or later and newer than what is known, else follow it from its epoch."""
        rid = info.replica_id
        rep = self._replicas.get(rid)
        if snap is not None and snap.epoch >= info.epoch and (
            rep is None or (snap.epoch, snap.seq) > (rep.stream.epoch, rep.stream.seq)
        ):
            self._load(rid, rep or self._follow(rid, snap.epoch), snap)
        elif rep is None:
            self._follow(rid, info.epoch)
        elif rep.stream.start_epoch(info.epoch):
            self._drop_epoch(rid)

    def heartbeat(self, info: ReplicaInfo, snapshot_at: tuple[int, int] | None, *, caught_up: bool) -> None:
        """A routable replica's heartbeat between bootstraps (``snapshot_at``: its snapshot's
        position, if known; ``caught_up``: the streams were read to their end): notice a new epoch
        or a stall. A replica not followed yet (routable again, or idle since the start) is
        followed from the heartbeat's epoch: the stall check resyncs it."""
        rid = info.replica_id
        rep = self._replicas.get(rid)
        if rep is None:
            rep = self._follow(rid, info.epoch)
        elif rep.stream.start_epoch(info.epoch):
            self._drop_epoch(rid)
        stream = rep.stream
        if stream.check_stall(info.epoch, info.last_seq, snapshot_at, caught_up):
            log.info("kv consumer: %s: replica at seq %d, applied %d and stalled; resyncing",
                     rid, stream.floor, stream.seq)

    def _load(self, rid: str, rep: _Replica, snap: CacheSnapshot) -> None:
        media = {medium: hashes for medium, hashes in snap.media.items() if medium in MEDIA}
        with self.index_lock:
            self.index.load(rid, media)
        for batch in rep.stream.load_snapshot(snap.epoch, snap.seq):
            self._apply(rid, batch)

    # -- gaps --------------------------------------------------------------------------------------------
    @property
    def any_gap(self) -> bool:
        """Some replica waits for a snapshot (the consumer then reads Redis more often)."""
        return any(rep.stream.in_gap for rep in self._replicas.values())

    def gaps_due(self, now: float) -> list[str]:
        """The replicas whose open gap is due a look at their snapshot (``now``: monotonic s).
        Counts each gap in ``gaps`` the first time it is due."""
        due = []
        for rid, rep in self._replicas.items():
            stream = rep.stream
            if not stream.in_gap:
                continue
            if rep.gap_seen != stream.gaps_opened:  # a new gap: count it, look at once
                rep.gap_seen = stream.gaps_opened
                self.gaps += 1
            elif now < rep.next_check:
                continue
            rep.next_check = now + SNAPSHOT_POLL_S
            due.append(rid)
        return due

    def covers(self, rid: str, position: tuple[int, int]) -> bool:
        """Whether a snapshot at ``position`` (epoch, seq) would close ``rid``'s gap."""
        rep = self._replicas.get(rid)
        return rep is not None and rep.stream.covers(*position)

    def resync(self, rid: str, snap: CacheSnapshot) -> bool:
        """Load ``snap`` if it closes ``rid``'s gap (then True, counted in ``resyncs``)."""
        rep = self._replicas.get(rid)
        if rep is None or not rep.stream.covers(snap.epoch, snap.seq):
            return False
        log.info("kv consumer: %s: gap after seq %d; resynced from the snapshot at seq %d",
                 rid, rep.stream.seq, snap.seq)
        self._load(rid, rep, snap)
        self.resyncs += 1
        return True

    def request_due(self, rid: str, now: float) -> bool:
        """Whether to publish a snapshot request for ``rid`` now (its gap is still open and none
        went out in the last ``REQUEST_EVERY_S`` of this epoch); counted in ``snapshot_requests``."""
        rep = self._replicas.get(rid)
        if rep is None or not rep.stream.in_gap:
            return False
        stream = rep.stream
        if rep.request_epoch == stream.epoch and now - rep.last_request < REQUEST_EVERY_S:
            return False
        rep.request_epoch, rep.last_request = stream.epoch, now
        self.snapshot_requests += 1
        return True


__all__ = ["REQUEST_EVERY_S", "SNAPSHOT_POLL_S", "IndexFeed"]
