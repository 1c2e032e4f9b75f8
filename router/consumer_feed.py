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

Hostile input (anyone who can write to the streams feeds this): an entry that cannot be a
replica's is **rejected**: counted in ``rejected[reason]`` (the metric
``kvroute.router.events.rejected``), logged once per replica and reason, and, when its replica
and seq are known, taken as lost (a gap: the snapshot resyncs). Reasons (:data:`REJECT_REASONS`):
``fields`` (a missing or non-integer replica_id / epoch / seq / batch field), ``replica_id`` (not
UTF-8, or empty), ``wrong_stream`` (an entry in a stream its replica id does not shard to),
``too_large`` (over kvroute.events.MAX_BATCH_BYTES), ``undecodable``, ``hash_count`` and
``block_size`` (kvroute.events.batch_problem), ``medium`` (one event of an unknown medium, skipped;
the rest of its batch applies), ``snapshot`` (a snapshot that does not parse or names another
replica), ``heartbeat`` (a heartbeat that does not parse), ``error`` (an entry whose handling
raised: logged with its traceback; the other replicas go on).

Gap pacing (the consumer's side of a gap): each open gap's snapshot key is checked every
``SNAPSHOT_POLL_S`` (at once when the gap opens), and a snapshot request is published at most
every ``REQUEST_EVERY_S`` per replica and epoch.

Single-threaded: only the consumer thread calls it. Counters (``events_applied``, ...) are
plain ints, read from any thread; :class:`router.consumer.EventConsumer` documents them.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence

from kvroute.events import GPU, MAX_BATCH_BYTES, MEDIA, EventDecodeError, batch_problem, parse_message
from kvroute.ordering import Decision, ReplicaStream
from kvroute.redis_layout import F_BATCH, F_EPOCH, F_REPLICA_ID, F_SEQ
from kvroute.snapshot import CacheSnapshot
from kvroute.v1 import events_pb2
from router.index import BlockIndex, decode_events
from router.registry import ReplicaInfo, ReplicaRegistry

log = logging.getLogger("router.consumer")  # one logger for the consumer, whichever half logs

SNAPSHOT_POLL_S = 0.05  # how often an open gap re-reads the snapshot key
REQUEST_EVERY_S = 1.0  # how often an open gap re-publishes its snapshot request
MAX_GONE = 4096  # expired replicas remembered (their late entries are ignored)
REJECT_REASONS = ("fields", "replica_id", "wrong_stream", "too_large", "undecodable", "hash_count", "block_size",
                  "medium", "snapshot", "heartbeat", "error")
_ENTRY_REASONS = frozenset(REJECT_REASONS) - {"medium", "snapshot", "heartbeat"}  # whole entries skipped
_MAX_LOGGED = 10000  # (replica, reason) pairs remembered as logged: garbage ids must not grow memory

Batch = events_pb2.KVEventBatch
IndexBatch = tuple[float, list[tuple[str | None, str, Sequence[int]]]]
"""A batch as the index applies it: ``(ts, [(kind, medium, hashes)])``, kind the event's oneof field
name (None: none set), medium as sent ('' when unset); from router.index.decode_events or
:func:`events_of`."""


def events_of(batch: Batch) -> IndexBatch:
    """A parsed batch as the index applies it (what router.index.decode_events gives directly)."""
    events: list[tuple[str | None, str, Sequence[int]]] = []
    for ev in batch.events:
        which = ev.WhichOneof("event")
        if which == "block_stored" or which == "block_removed":
            e = getattr(ev, which)
            events.append((which, e.medium, e.block_hashes))
        else:
            events.append((which, ev.all_blocks_cleared.medium if which else "", ()))
    return batch.ts, events


def replica_of(fields: Mapping[bytes, bytes]) -> str:
    """A printable name for the replica a stream entry claims to be of (logs only)."""
    raw = fields.get(F_REPLICA_ID) if isinstance(fields, Mapping) else None
    if isinstance(raw, bytes):
        return raw[:64].decode(errors="backslashreplace") or "<empty replica_id>"
    return "<no replica_id>"


class _Replica:
    """One replica's ordering state and the pacing of its open gap."""

    __slots__ = ("stream", "gap_seen", "next_check", "request_epoch", "last_request")

    def __init__(self, epoch: int):
        self.stream: ReplicaStream[IndexBatch] = ReplicaStream(epoch)
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
        self.rejected: dict[str, int] = dict.fromkeys(REJECT_REASONS, 0)
        self._logged: set[tuple[str, str]] = set()
        self.stream_lag_seconds = 0.0
        self._block_size = registry.expected_identity[2]

    @property
    def bad_entries(self) -> int:
        """Stream entries rejected whole (every reason but ``medium``, ``snapshot``, ``heartbeat``)."""
        return sum(n for reason, n in self.rejected.items() if reason in _ENTRY_REASONS)

    def reject(self, rid: str, reason: str, detail: str, *, exc_info: bool = False) -> None:
        """Count one rejected input of replica ``rid`` (as far as it can be told) under ``reason``
        (one of :data:`REJECT_REASONS`); the first of each replica and reason is logged."""
        self.rejected[reason] += 1
        key = (rid, reason)
        if key in self._logged or len(self._logged) >= _MAX_LOGGED:
            return
        self._logged.add(key)
        log.warning("kv consumer: %s: rejected (%s): %s; further %s rejections of it are counted, not logged",
                    rid, reason, detail, reason, exc_info=exc_info)

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
    def stream_entry(self, stream: str, entry_id: bytes, fields: Mapping[bytes, bytes],
                     stream_of: Callable[[str], str], *, history: bool) -> None:
        """One stream entry as redis-py returns it (field name -> bytes), read from ``stream``
        (``stream_of(replica_id)``: the stream that id shards to): its fields checked, then
        :meth:`entry`; rejected under ``fields``, ``replica_id`` or ``wrong_stream`` otherwise."""
        raw_id = fields.get(F_REPLICA_ID)
        try:
            rid = raw_id.decode() if isinstance(raw_id, bytes) else None
        except UnicodeDecodeError:
            rid = None
        if not rid:
            self.reject(replica_of(fields), "replica_id" if raw_id is not None else "fields",
                        f"entry {entry_id!r} of {stream}: replica_id {raw_id!r:.80}")
            return
        if stream_of(rid) != stream:
            self.reject(rid, "wrong_stream", f"entry {entry_id!r} is in {stream}, not {stream_of(rid)}")
            return
        try:
            epoch, seq = int(fields[F_EPOCH]), int(fields[F_SEQ])
            data = fields[F_BATCH]
            if not (0 <= epoch < 2**64 and 0 <= seq < 2**64):
                raise ValueError("epoch / seq out of range")
        except (KeyError, ValueError, UnicodeDecodeError) as e:
            self.reject(rid, "fields", f"entry {entry_id!r}: {type(e).__name__} {e}")
            return
        self.entry(rid, epoch, seq, data, history=history)

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
        if len(data) > MAX_BATCH_BYTES:
            self.lost(rid, epoch, seq, "too_large", f"seq {seq}: {len(data)} bytes > {MAX_BATCH_BYTES}")
            return
        batch = decode_events(data, self._block_size)  # the compiled reader of the form replicas write
        if batch is None:  # upb decides what the rest is
            try:
                message = parse_message(Batch, data)
            except EventDecodeError as e:
                self.lost(rid, epoch, seq, "undecodable", f"seq {seq}: {e}")
                return
            problem = batch_problem(message, self._block_size)
            if problem is not None:
                self.lost(rid, epoch, seq, problem[0], f"seq {seq}: {problem[1]}")
                return
            batch = events_of(message)
        self._act(rid, stream.offer(epoch, seq, batch))

    def lost(self, rid: str, epoch: int, seq: int, reason: str, detail: str) -> None:
        """Reject entry ``seq`` of ``rid`` (see :meth:`reject`) and take it as lost: a followed
        replica's stream then waits for a snapshot past it."""
        self.reject(rid, reason, detail)
        rep = self._replicas.get(rid)
        if rep is not None and not rep.stream.is_stale(epoch, seq):
            self._act(rid, rep.stream.lost(epoch, seq))

    def _act(self, rid: str, decision: Decision[IndexBatch]) -> None:
        if decision.new_epoch:
            self._drop_epoch(rid)
        for batch in decision.apply:
            self._apply(rid, batch)

    def _drop_epoch(self, rid: str) -> None:
        log.info("kv consumer: %s: new epoch %d; dropping its entries", rid, self._replicas[rid].stream.epoch)
        with self.index_lock:
            self.index.clear_replica(rid)
        self.epoch_changes += 1

    def _apply(self, rid: str, batch: IndexBatch) -> None:
        """Apply one decoded batch to the index."""
        index = self.index
        blocks = 0
        unknown: list[str] = []
        ts, events = batch
        # One index call per event with its whole hash list: the per-hash loop lives in the index.
        with self.index_lock:
            for which, medium, hashes in events:
                if which == "block_stored" or which == "block_removed":
                    if (medium := medium or GPU) in MEDIA:
                        (index.add if which == "block_stored" else index.remove)(rid, hashes, medium)
                        blocks += len(hashes)
                    else:
                        unknown.append(medium)
                elif which == "all_blocks_cleared":
                    if not medium or medium in MEDIA:
                        index.clear_replica(rid, medium or None)
                    else:
                        unknown.append(medium)
        for medium in unknown:
            self.reject(rid, "medium", f"an event of the unknown medium {medium[:64]!r} skipped")
        self.events_applied += len(events)
        self.blocks_applied += blocks
        self.batches_applied += 1
        if math.isfinite(ts):  # a hostile ts (NaN, inf) leaves the gauge as it was
            self.stream_lag_seconds = max(0.0, time.time() - ts)

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


__all__ = ["REJECT_REASONS", "REQUEST_EVERY_S", "SNAPSHOT_POLL_S", "IndexFeed", "replica_of"]
