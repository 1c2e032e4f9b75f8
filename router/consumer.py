"""EventConsumer: keeps the router's BlockIndex and ReplicaRegistry in step with Redis (DESIGN.md §4, §5).

The router's only reader of the replicas' KV event streams, heartbeats and snapshots: this module
is the Redis side (one thread of blocking redis-py calls, so request handling on the gRPC asyncio
loop never waits on Redis); what it reads goes to :class:`router.consumer_feed.IndexFeed`, which
runs each replica's kvroute.ordering rules and writes the index under ``index_lock``. Heartbeats
and snapshots are read through router.consumer_reads, which turns a hostile key into one rejected
input rather than a lost connection; the streams through router.consumer_streams (a blocking
XREAD per stream, as a Redis Cluster has each shard's stream in a slot of its own).

    Redis kvroute:{ns:k}:...     consumer thread (here)              IndexFeed (no I/O)
    ─────                        ──────────────────────              ──────────────────
    events (each k) ─XREAD BLOCK─▶ entries ─────────────────────────▶ entry: ordering ──▶ BlockIndex
    snapshot:{id}  ──GET─────────▶ bootstrap, gaps_due ─────────────▶ bootstrap / resync     (index_lock)
                   ──GETRANGE────▶ snapshot_position (its head) ────▶ covers, stall check
    replica:{id}   ──SCAN+HGETALL▶ Heartbeat.from_redis ──▶ ReplicaRegistry ──▶ heartbeat (epoch, stall)
    snapshot-requests ◀──PUBLISH {id}── when request_due

Per replica (kvroute.ordering): a larger epoch drops the replica's entries; an older epoch or a seq
already applied is ignored; the next seq is applied; a later one is held until the hole fills (a
reorder). A hole still open when the read that found it ends is a **gap**: the replica's snapshot
is loaded once it is valid at or after the hole (then only held entries after its seq apply);
until then a snapshot request is published every second and the snapshot's head (its first 128
bytes: kvroute.snapshot.snapshot_position) is read every 50 ms. A replica known to be past what was
applied (its heartbeat's ``last_seq``, or its snapshot's seq) with no progress for a whole poll
while the streams are read to their end is a gap too (entries lost at the tail).

Bootstrap (start, and after every reconnect): poll heartbeats, load each routable replica's snapshot
(when it is newer than what is known), then read every stream from the start of what is retained,
skipping entries at or below each replica's seq (and entries of replicas that no longer heartbeat).
A heartbeat key that is gone expires the replica (``registry.expire``; its entries are dropped,
and its late entries of that epoch are ignored, not followed into a gap: ``IndexFeed.expire``),
except in the first ``expiry_grace`` seconds after a reconnect, while replicas re-register.

A Redis Cluster that lost a node (a failover: ClusterDownError, TRYAGAIN, a connection error) is
reconnected without a bootstrap: what its replicas had replicated is still there, so the stream
positions stay, and what the failover lost shows as a seq gap of each replica concerned, resynced
from its snapshot (re-reading every shard's stream on every failover would cost each router a
full replay). A single Redis may have restarted empty, so a reconnect to it bootstraps.

The index only holds replicas that are routable, or not yet seen in a heartbeat: the registry's
``on_removed`` drops a replica's entries when it expires or stops being routable (discovery removed
it, or its hash triple is refused); if it comes back, a snapshot resyncs it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvroute.heartbeat import Heartbeat
from kvroute.redis_connect import (
    LOST_REDIS_ERRORS,
    RedisAuth,
    connect,
    describe_error,
    is_cluster,
    ping,
    redact,
)
from kvroute.redis_layout import RedisLayout
from kvroute.snapshot import CacheSnapshot
from router.consumer_feed import SNAPSHOT_POLL_S, IndexFeed, replica_of
from router.consumer_reads import read_heartbeats, read_snapshot, read_snapshot_position
from router.consumer_streams import StreamReads
from router.index import BlockIndex
from router.registry import ReplicaInfo, ReplicaRegistry

log = logging.getLogger(__name__)

_XREAD_COUNT = 1000  # entries per stream per XREAD: bounds one read's latency while catching up
_MIN_BACKOFF_S = 0.05
_MAX_BACKOFF_S = 1.0


def _parse_id(entry_id: bytes | str) -> tuple[int, int]:
    ms, _, seq = (entry_id.decode() if isinstance(entry_id, bytes) else entry_id).partition("-")
    return int(ms), int(seq or 0)


def _from_feed(name: str, doc: str) -> property:
    return property(lambda self: getattr(self.feed, name), doc=doc)


class EventConsumer:
    """Follows the KV event streams, heartbeats and snapshots of one namespace into ``index`` and
    ``registry`` on a background thread.

    Owns the Redis connection, the stream read positions and the bootstrap; ``feed``
    (:class:`router.consumer_feed.IndexFeed`) owns the per-replica ordering state and every
    BlockIndex write, under ``index_lock``; other threads that use the index (lookups, speculative
    entries) take the same lock.

    Args:
        redis_url: the cluster's Redis (``redis://host:port/db``; several seeds of a Redis Cluster,
            comma-separated, or one with ``auth.cluster``).
        layout: the cluster's key layout (namespace, shards).
        index: the index to keep current.
        registry: the replica registry to feed with heartbeats; its ``on_removed`` drops index entries.
        heartbeat_poll_interval: seconds between heartbeat polls (expiry is noticed this late).
        block_ms: XREAD BLOCK timeout (each stream's); also how late ``stop`` can be.
        expiry_grace: seconds after a reconnect during which missing heartbeats expire nobody.
        index_lock: the lock shared with the index's other users (default: a new one).
        auth: the Redis credentials (kvroute.redis_connect; default none).

    Raises:
        ValueError: a non-positive ``heartbeat_poll_interval`` or ``block_ms``.

    Stats (read from any thread): the counters below, ``reconnects``, ``connected``; ``entries()``
    for the index size per replica; ``stats()`` for all of them as one dict.
    """

    events_applied = _from_feed("events_applied", "KV events applied to the index.")
    blocks_applied = _from_feed("blocks_applied", "Hashes in applied events.")
    batches_applied = _from_feed("batches_applied", "Stream entries applied.")
    stale_batches = _from_feed("stale_batches", "Entries ignored: duplicates, old epochs.")
    gaps = _from_feed("gaps", "Seq gaps found (each counted once).")
    resyncs = _from_feed("resyncs", "Snapshot loads that closed a gap.")
    snapshot_requests = _from_feed("snapshot_requests", "Snapshot requests published.")
    epoch_changes = _from_feed("epoch_changes", "Replica restarts seen (new epochs).")
    bad_entries = _from_feed("bad_entries", "Entries rejected whole (router.consumer_feed: hostile input).")
    rejected = _from_feed("rejected", "Rejected inputs per reason (router.consumer_feed.REJECT_REASONS).")
    stream_lag_seconds = _from_feed("stream_lag_seconds", "Wall clock minus the batch ts at the last applied batch.")

    def __init__(
        self,
        redis_url: str,
        layout: RedisLayout,
        index: BlockIndex,
        registry: ReplicaRegistry,
        *,
        heartbeat_poll_interval: float = 0.5,
        block_ms: int = 100,
        expiry_grace: float = 3.0,
        index_lock: threading.Lock | None = None,
        auth: RedisAuth | None = None,
    ):
        if heartbeat_poll_interval <= 0 or block_ms < 1:
            raise ValueError("heartbeat_poll_interval, block_ms: must be > 0")
        self.redis_url = redis_url
        self.auth = auth
        self._cluster = is_cluster(redis_url, auth)
        self.layout = layout
        self.index = index
        self.registry = registry
        self.heartbeat_poll_interval = heartbeat_poll_interval
        self.block_ms = int(block_ms)
        self.expiry_grace = expiry_grace
        self.index_lock = index_lock if index_lock is not None else threading.Lock()
        self.feed = IndexFeed(index, registry, self.index_lock)

        # Consumer-thread state.
        self._client: redis.Redis | None = None
        self._reads: StreamReads | None = None
        self._stream_ids: dict[str, bytes] = {}
        self._backlog_until: dict[str, tuple[int, int]] = {}
        self._behind: set[str] = set()  # streams not read to their end yet (a full reply, or the backlog)
        self._needs_bootstrap = True
        self._bootstrapped_once = False
        self._grace_until = 0.0
        self._next_heartbeat_poll = 0.0
        self._caught_up = False
        self._logged_down = False
        self._reconnect_pending = False  # connected again after a bootstrap; not counted yet
        # Shared.
        self._removed: deque[str] = deque()  # on_removed calls, from any thread, handled here
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self._on_removed = self._removed.append
        registry.add_listener(self._on_removed)

        self.reconnects = 0
        self.connected = False

    # -- lifecycle -----------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the consumer thread (bootstraps in the background; see ``wait_ready``).

        Raises:
            RuntimeError: started twice.
        """
        if self._thread is not None:
            raise RuntimeError("EventConsumer.start: already started")
        self._thread = threading.Thread(target=self._run, name="kv-consumer", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        """Stop the thread (within about ``block_ms``) and close the connection."""
        self._stop.set()
        self.registry.remove_listener(self._on_removed)
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout)

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the first bootstrap has read every stream to its end; False on timeout."""
        return self._ready.wait(timeout)

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    def entries(self) -> dict[str, int]:
        """Distinct hashes indexed per replica (all media)."""
        with self.index_lock:
            return {r: self.index.num_entries(r) for r in self.index.replicas}

    def stats(self) -> dict[str, Any]:
        """The counters above as one dict (metrics export)."""
        return {
            **{name: getattr(self.feed, name) for name in IndexFeed.COUNTERS},
            "rejected": dict(self.feed.rejected),
            "reconnects": self.reconnects,
            "connected": self.connected,
            "entries": self.entries(),
        }

    # -- the consumer thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        streams = self.layout.all_event_streams()
        # One XREAD may name several streams only within one hash slot: a cluster's are one each.
        self._reads = StreamReads([[s] for s in streams] if self._cluster else [streams], _XREAD_COUNT)
        try:
            self._follow()
        finally:
            self._disconnect()
            self._reads.close()

    def _follow(self) -> None:
        backoff = _MIN_BACKOFF_S
        while not self._stop.is_set():
            if self._client is None and not self._connect():
                self._stop.wait(backoff)
                backoff = min(backoff * 2, _MAX_BACKOFF_S)
                continue
            try:
                if self._needs_bootstrap:
                    self._bootstrap()
                self._step()
                if self._logged_down or self._reconnect_pending:
                    self._back_up()
                backoff = _MIN_BACKOFF_S
            except LOST_REDIS_ERRORS as e:
                if not self._logged_down:  # once per outage: a failover can take many tries
                    log.warning("kv consumer: lost Redis (%s); reconnecting", describe_error(self.redis_url, e))
                    self._logged_down = True
                self._disconnect()
                # A cluster mid-failover may take the connection and fail the reads: not at once again.
                self._stop.wait(backoff)
                backoff = min(backoff * 2, _MAX_BACKOFF_S)
                continue
            except Exception:  # noqa: BLE001 - the thread must survive anything
                log.exception("kv consumer: unexpected error; reconnecting")
                self._disconnect()
                self._stop.wait(_MAX_BACKOFF_S)

    def _connect(self) -> bool:
        try:
            client = connect(
                self.redis_url, self.auth,
                socket_connect_timeout=1.0,
                socket_timeout=self.block_ms / 1000 + 5.0,
                retry=Retry(NoBackoff(), 0),
            )
            ping(client)
        except (redis.RedisError, *LOST_REDIS_ERRORS) as e:
            if not self._logged_down:  # once per outage, not once per retry
                log.warning("kv consumer: Redis unreachable (%s); retrying", describe_error(self.redis_url, e))
                self._logged_down = True
            return False
        resume = self._bootstrapped_once and self._cluster
        self._reconnect_pending = self._bootstrapped_once
        self._client = client
        self.connected = True
        self._needs_bootstrap = not resume
        if resume:  # the replicas re-register on the new nodes meanwhile
            self._grace_until = time.monotonic() + self.expiry_grace
        return True

    def _back_up(self) -> None:
        """A round went through on a new connection, or after an outage: it is over (logged and
        counted once, not once per try of a flapping failover)."""
        self._logged_down = False
        if self._reconnect_pending:
            self._reconnect_pending = False
            self.reconnects += 1
            log.info("kv consumer: reconnected to Redis at %s; %s", redact(self.redis_url),
                     "followed the streams on (a cluster)" if self._cluster else "re-bootstrapped")

    def _disconnect(self) -> None:
        self.connected = False
        if self._reads is not None:  # what reads on this client bring back is not applied
            self._reads.reset()
        if self._client is not None:
            with contextlib.suppress(Exception):  # closing a dead connection
                self._client.close()
        self._client = None

    def _bootstrap(self) -> None:
        """Heartbeats, then snapshots newer than what is known, then every stream from its start."""
        client = self._client
        assert client is not None
        reconnect = self._bootstrapped_once
        self._grace_until = time.monotonic() + self.expiry_grace if reconnect else 0.0
        self._caught_up = False
        streams = self.layout.all_event_streams()
        self._stream_ids = dict.fromkeys(streams, b"0-0")  # (no reads out: _disconnect reset them)
        self._backlog_until = {}
        for stream in streams:
            last = client.xrevrange(stream, count=1)
            self._backlog_until[stream] = _parse_id(last[0][0]) if last else (0, 0)
        self._behind = {stream for stream, last in self._backlog_until.items() if last > (0, 0)}
        heartbeats = self._poll_heartbeats(bootstrap=True)
        for rid, info in heartbeats.items():
            if info.routable:
                self.feed.bootstrap(info, self._get_snapshot(rid))
        self._next_heartbeat_poll = time.monotonic() + self.heartbeat_poll_interval
        self._needs_bootstrap = False
        self._bootstrapped_once = True

    def _step(self) -> None:
        """One round: removals, heartbeats when due, open gaps, the XREADs back by then and their entries."""
        client = self._client
        assert client is not None and self._reads is not None
        self._handle_removals()
        now = time.monotonic()
        if now >= self._next_heartbeat_poll:
            self._poll_heartbeats(bootstrap=False)
            self._next_heartbeat_poll = now + self.heartbeat_poll_interval
        self._service_gaps()
        block = min(self.block_ms, int(SNAPSHOT_POLL_S * 1000)) if self.feed.any_gap else self.block_ms
        block = max(1, min(block, int((self._next_heartbeat_poll - time.monotonic()) * 1000) + 1))
        for name, entries in self._reads.read(client, self._stream_ids, block):
            if len(entries) >= _XREAD_COUNT:
                self._behind.add(name)  # more to read at once
            else:
                self._behind.discard(name)  # read to the end it had when the reply left
            backlog = self._backlog_until.get(name)
            for entry_id, fields in entries:
                try:
                    self._handle_entry(name, entry_id, fields, backlog)
                except redis.RedisError:
                    raise
                except Exception as e:  # noqa: BLE001 - one entry must not stall every replica
                    self.feed.reject(replica_of(fields), "error", f"entry {entry_id!r}: {e!r}", exc_info=True)
            self._stream_ids[name] = entries[-1][0]
        self._caught_up = caught_up = not self._behind
        if caught_up:
            self._backlog_until = {}
            if not self._ready.is_set():
                self._ready.set()
        self._service_gaps()

    def _handle_entry(self, stream: str, entry_id: bytes, fields: dict, backlog: tuple[int, int] | None) -> None:
        history = backlog is not None and _parse_id(entry_id) <= backlog
        self.feed.stream_entry(stream, entry_id, fields, self.layout.events_stream, history=history)

    # -- heartbeats ------------------------------------------------------------------------------------
    def _poll_heartbeats(self, *, bootstrap: bool) -> dict[str, ReplicaInfo]:
        """Feed every heartbeat to the registry; expire the missing; notice new epochs and stalls."""
        client = self._client
        assert client is not None
        records = read_heartbeats(client, self.layout, self.feed.reject)
        now = time.monotonic()
        present: dict[str, ReplicaInfo] = {}
        heads = {}
        for rid, raw, head in records:
            try:
                info = self.registry.update_from_heartbeat(Heartbeat.from_redis(raw), now)
            except ValueError as e:
                self.feed.reject(rid[:64], "heartbeat", str(e))
                continue
            present[info.replica_id] = info
            heads[info.replica_id] = head
        if now >= self._grace_until:
            for info in self.registry.all():
                if info.replica_id not in present:
                    self.feed.expire(info.replica_id, info.epoch)  # its late entries are ignored now
                    self.registry.expire(info.replica_id)
            for rid in self.feed.replicas():
                if rid not in present:  # entries seen, heartbeat never (or no longer) seen
                    self.feed.expire(rid)
        self._handle_removals()
        followed = set(self.feed.replicas())
        for rid, info in present.items():
            if not info.routable:
                if rid in followed:
                    self.feed.drop(rid)
            elif not bootstrap:
                self.feed.heartbeat(info, heads[rid], caught_up=self._caught_up)
        return present

    def _handle_removals(self) -> None:
        while self._removed:
            self.feed.drop(self._removed.popleft())

    # -- snapshots -----------------------------------------------------------------------------------------
    def _get_snapshot(self, rid: str) -> CacheSnapshot | None:
        assert self._client is not None
        return read_snapshot(self._client, self.layout, rid, self.feed.reject)

    def _service_gaps(self) -> None:
        """For each open gap that is due: load the snapshot if it covers the hole, else ask for one."""
        client = self._client
        if client is None:
            return
        now = time.monotonic()
        for rid in self.feed.gaps_due(now):
            # The head first: an old snapshot (megabytes) is not fetched every 50 ms.
            head = read_snapshot_position(client, self.layout, rid)
            if head is None or self.feed.covers(rid, head):
                snap = self._get_snapshot(rid)
                if snap is not None:
                    self.feed.resync(rid, snap)
            if self.feed.request_due(rid, now):
                client.publish(self.layout.snapshot_requests_channel(rid), rid)


__all__ = ["EventConsumer"]
