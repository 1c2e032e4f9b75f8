"""RedisEventPublisher: the replica's only writer to Redis (DESIGN.md §3.3, §4).

    engine thread (never blocks)                         publisher thread (all network I/O)
    ────────────────────────────                         ─────────────────────────────────
    on_step(events, load, snapshot_fn)                   drain: XADD batches (MAXLEN ~), SET snapshots,
      seq += 1, encode_batch ──▶ bounded buffer ──────▶         in order, one MULTI/EXEC per chunk
      snapshot_fn() when wanted ─▶ (after the batches)    heartbeat: HSET + PEXPIRE every interval
      buffer full: drop + count, want a snapshot          (and at once on start_draining; none while
    serving_alive() (the serving process, any thread)      the serving process is silent past the TTL)
                                                          SUBSCRIBE snapshot-requests: want a snapshot
                                                          Redis (or a cluster node) down: back off
                                                          (cap 1 s), reconnect, heartbeat at once,
                                                          want a fresh snapshot

Guarantees:
- Batch ``seq`` 1 of an epoch is ``[AllBlocksCleared(None)]`` alone, so readers drop what they knew
  of this replica; every later engine step with events gets the next seq, published or dropped.
  A dropped batch leaves a seq gap, and a snapshot valid at a later seq follows it.
- A snapshot is taken on the engine thread right after a step, so its ``seq`` (the last seq
  assigned) is exact; it is written in the same transaction as the batches before it, so a reader
  that sees a gap finds a snapshot that covers it.
- After an ambiguous write failure (the connection drops during EXEC) the batches are written
  again: readers ignore entries at or below the seq they have (kvroute.ordering).
- Nothing here raises into the engine; Redis being slow or down only costs dropped batches.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Sequence

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvroute.engine_info import EngineInfo
from kvroute.events import AllBlocksCleared, KVCacheEvent, encode_batch
from kvroute.heartbeat import ENGINE_KVROUTE, EngineLoad, Heartbeat
from kvroute.redis_connect import LOST_REDIS_ERRORS, RedisAuth, connect, describe_error, ping, redact
from kvroute.redis_layout import F_BATCH, F_EPOCH, F_REPLICA_ID, F_SEQ, RedisLayout
from kvroute.snapshot import CacheSnapshot, encode_snapshot
from replica.publisher.base import EventPublisher, PublisherStats, SnapshotFn

log = logging.getLogger(__name__)

_MAX_BACKOFF_S = 1.0
_MIN_BACKOFF_S = 0.05
_IDLE_POLL_S = 0.05  # how often an idle publisher thread checks pub/sub and the heartbeat clock
_WRITE_CHUNK = 512  # buffered items per MULTI/EXEC when catching up after an outage


class _Batch:
    __slots__ = ("seq", "data", "num_events")

    def __init__(self, seq: int, data: bytes, num_events: int):
        self.seq, self.data, self.num_events = seq, data, num_events


class RedisEventPublisher(EventPublisher):
    """Publishes one replica's KV event batches, snapshots and heartbeats to Redis (its counters:
    :meth:`stats`, from any thread).

    Owns the bounded buffer between the engine thread and the publisher thread and the seq
    counter of the epoch. Invariant: seqs are assigned only on the engine thread (``start`` assigns
    seq 1 before the engine runs), and snapshots are taken there too, so a snapshot's seq and its
    content agree.

    Args:
        redis_url: where to publish (``redis://host:port/db``).
        layout: the cluster's key layout.
        replica_id: this replica's id in the cluster.
        info: the engine's identity (its heartbeat part goes into every heartbeat).
        address: where this replica serves gRPC (``host:port``), for the heartbeat.
        epoch: default ``time.time_ns()`` when the publisher is made (one publisher per replica start).
        heartbeat_interval: seconds between heartbeats.
        heartbeat_ttl: seconds the heartbeat key lives (None: 3 intervals), at least one
            interval: how long a replica that stopped heartbeating stays routable.
        snapshot_interval: seconds between periodic snapshots.
        buffer_size: event batches held while Redis is slow or down; more are dropped.
        stream_maxlen: approximate MAXLEN of the event stream.
        auth: the Redis credentials (kvroute.redis_connect; default none).
        engine: what serves at ``address`` (kvroute.heartbeat.ENGINES): ``"vllm"`` for the bridge
            beside a vLLM server, whose ``address`` is that server's HTTP ``host:port``.
        max_waiting: the replica's waiting-queue bound, for the heartbeat (0: not said).

    Raises:
        ValueError: a non-positive interval / size, or a TTL shorter than the interval.
    """

    def __init__(
        self,
        redis_url: str,
        layout: RedisLayout,
        replica_id: str,
        info: EngineInfo,
        address: str,
        *,
        epoch: int | None = None,
        heartbeat_interval: float = 1.0,
        snapshot_interval: float = 30.0,
        buffer_size: int = 10000,
        stream_maxlen: int = 100000,
        auth: RedisAuth | None = None,
        max_waiting: int = 0,
        heartbeat_ttl: float | None = None,
        engine: str = ENGINE_KVROUTE,
    ):
        if heartbeat_interval <= 0 or snapshot_interval <= 0:
            raise ValueError("heartbeat_interval, snapshot_interval: must be > 0")
        if heartbeat_ttl is not None and not heartbeat_ttl >= heartbeat_interval:
            raise ValueError(f"heartbeat_ttl: must be >= heartbeat_interval ({heartbeat_interval}), got {heartbeat_ttl}")
        if buffer_size < 1 or stream_maxlen < 1:
            raise ValueError("buffer_size, stream_maxlen: must be >= 1")
        self.redis_url = redis_url
        self.auth = auth
        self.layout = layout
        self.replica_id = replica_id
        self.epoch = time.time_ns() if epoch is None else int(epoch)
        self._heartbeat = Heartbeat.of(
            info, replica_id=replica_id, address=address, epoch=self.epoch, last_seq=0,
            load=EngineLoad(free_blocks=max(info.num_blocks - 1, 0)), ts=0.0, max_waiting=max_waiting,
            engine=engine,
        )
        self.heartbeat_interval = heartbeat_interval
        self.snapshot_interval = snapshot_interval
        self.buffer_size = buffer_size
        self.stream_maxlen = stream_maxlen
        self._stream = layout.events_stream(replica_id)
        self._hb_key = layout.heartbeat_key(replica_id)
        self._snapshot_key = layout.snapshot_key(replica_id)
        # Rounded first: 3 * 0.2 * 1000 is 600.0000000000001, which would ceil to 601.
        ttl_s = 3 * heartbeat_interval if heartbeat_ttl is None else heartbeat_ttl
        self._ttl_ms = math.ceil(round(ttl_s * 1000, 3))
        self._ttl_s = self._ttl_ms / 1000

        # Engine thread state.
        self.last_seq = 0
        self._next_periodic_snapshot = 0.0
        # Shared state: the buffer (under _lock) and a few flags set from any thread.
        self._lock = threading.Lock()
        self._buffer: collections.deque[_Batch | CacheSnapshot] = collections.deque()
        self._num_buffered_batches = 0
        self._snapshot_wanted = threading.Event()
        self._snapshot_wanted.set()  # the first snapshot of the epoch
        self._load = self._heartbeat.load
        self._wake = threading.Event()
        self._heartbeat_due = threading.Event()  # write one now, not at the next period (draining)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._client: redis.Redis | None = None
        self._pubsub: redis.client.PubSub | None = None
        self._ever_up = False
        self._logged_down = False
        self._backoff = _MIN_BACKOFF_S
        self._serving_said: float | None = None  # time.monotonic() of the last serving_alive(); None: never told
        self._logged_silent = False

        # Stats.
        self.batches_published = 0
        self.events_published = 0
        self._dropped_on_step = 0  # buffer full (engine thread)
        self._dropped_on_write = 0  # refused by Redis (publisher thread)
        self.snapshots_written = 0
        self.connected = False
        self.last_seq_written = 0
        self.reconnects = 0

    # -- lifecycle (caller's thread) -------------------------------------------------------------
    def start(self) -> None:
        """Queue seq 1 (``AllBlocksCleared``) and start the publisher thread. Call before the engine runs.

        Raises:
            RuntimeError: started twice (make a new publisher, with a new epoch, instead).
        """
        if self._thread is not None:
            raise RuntimeError("RedisEventPublisher.start: already started")
        self._enqueue_batch([AllBlocksCleared(medium=None)])
        self._thread = threading.Thread(target=self._run, name=f"kv-publisher-{self.replica_id}", daemon=True)
        self._thread.start()

    def close(self, timeout: float = 2.0) -> None:
        """Stop: flush what is buffered if Redis is up (best effort), stop heartbeating.

        The heartbeat key is left to expire (its TTL), like a crashed replica's.
        """
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def batches_dropped(self) -> int:
        """Batches that never reached Redis (their seqs are gaps in the stream)."""
        return self._dropped_on_step + self._dropped_on_write

    def stats(self) -> PublisherStats:
        return PublisherStats(
            last_seq=self.last_seq, batches_published=self.batches_published,
            events_published=self.events_published, batches_dropped=self.batches_dropped,
            snapshots_written=self.snapshots_written, last_seq_written=self.last_seq_written,
            reconnects=self.reconnects, connected=self.connected,
        )

    def request_snapshot(self) -> None:
        """Ask for a snapshot after the next engine step (thread-safe; the RequestSnapshot rpc)."""
        self._snapshot_wanted.set()

    def start_draining(self) -> None:
        """Every heartbeat from now on says ``draining``; one is written at once (thread-safe)."""
        self._heartbeat = dataclasses.replace(self._heartbeat, draining=True)
        self._heartbeat_due.set()
        self._wake.set()

    def serving_alive(self) -> None:
        """The serving process is alive now (thread-safe; see ``EventPublisher.serving_alive``)."""
        self._serving_said = time.monotonic()

    def _serving_silent_s(self) -> float | None:
        """Seconds the serving process has been silent past the heartbeat's TTL (None: it is not,
        it never spoke, or this replica is draining, whose heartbeat must still go out)."""
        said = self._serving_said
        if said is None or self._heartbeat.draining:
            return None
        silent = time.monotonic() - said
        return silent if silent > self._ttl_s else None

    # -- the engine thread ----------------------------------------------------------------------
    def on_step(self, events: Sequence[KVCacheEvent], load: EngineLoad, snapshot_fn: SnapshotFn) -> None:
        """Queue one engine step's events (if any) and, when one is wanted, a snapshot.

        Runs on the engine thread after each step: no network I/O, never blocks, never raises.
        """
        try:
            self._load = load
            if events:
                self._enqueue_batch(events)
            now = time.monotonic()
            if now >= self._next_periodic_snapshot:
                self._snapshot_wanted.set()
            # Deferred while Redis is down (the snapshot would be stale by the time it is written,
            # and a reconnect asks for a fresh one) or the buffer is full (one per step would cost
            # a full set copy per step for nothing).
            if (
                self._snapshot_wanted.is_set()
                and self.connected
                and self._num_buffered_batches < self.buffer_size
            ):
                self._snapshot_wanted.clear()
                self._next_periodic_snapshot = now + self.snapshot_interval
                snap = CacheSnapshot(self.replica_id, self.epoch, self.last_seq, time.time(), snapshot_fn())
                with self._lock:
                    self._buffer.append(snap)
                self._wake.set()
        except Exception:  # noqa: BLE001 - never raise into the engine
            log.exception("kv publisher: on_step failed")

    def _enqueue_batch(self, events: Sequence[KVCacheEvent]) -> None:
        self.last_seq += 1
        seq = self.last_seq
        # Only this thread adds batches, so "not full" read here stays true until the append;
        # encoding outside the lock keeps the publisher thread from ever waiting on it.
        full = self._num_buffered_batches >= self.buffer_size
        if not full:
            item = _Batch(seq, encode_batch(events, time.time()), len(events))
            with self._lock:
                self._buffer.append(item)
                self._num_buffered_batches += 1
        if full:
            self._dropped_on_step += 1
            self._snapshot_wanted.set()
        else:
            self._wake.set()

    # -- the publisher thread -------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.connected and not self._connect():
                self._back_off()
                continue
            try:
                self._serve()
            except LOST_REDIS_ERRORS as e:
                if not self._logged_down:  # once per outage: a failover can take many tries
                    log.warning(
                        "kv publisher: lost Redis (%s); buffering, will reconnect", describe_error(self.redis_url, e)
                    )
                    self._logged_down = True
                self._disconnect()
                # A cluster mid-failover may take the connection and refuse the writes: not at once again.
                self._back_off()
            except Exception:  # noqa: BLE001 - the thread must survive anything
                log.exception("kv publisher: unexpected error; reconnecting")
                self._disconnect()
        if self.connected:  # best-effort final flush, bounded in case the engine still runs
            deadline = time.monotonic() + 1.0
            try:
                while self._write_some() and time.monotonic() < deadline:
                    pass
            except Exception as e:  # noqa: BLE001
                log.warning("kv publisher: final flush failed (%s)", e)
        self._disconnect()

    def _back_off(self) -> None:
        self._stop.wait(self._backoff)
        self._backoff = min(self._backoff * 2, _MAX_BACKOFF_S)

    def _connect(self) -> bool:
        try:
            client = connect(
                self.redis_url, self.auth, socket_connect_timeout=1.0, socket_timeout=2.0, retry=Retry(NoBackoff(), 0)
            )
            ping(client)
            pubsub = client.pubsub(ignore_subscribe_messages=True)
            pubsub.subscribe(self.layout.snapshot_requests_channel(self.replica_id))
        except (redis.RedisError, *LOST_REDIS_ERRORS) as e:
            if not self._logged_down:  # once per outage, not once per retry
                log.warning(
                    "kv publisher: Redis unreachable (%s); buffering, retrying", describe_error(self.redis_url, e)
                )
                self._logged_down = True
            return False
        self._client, self._pubsub = client, pubsub
        self.connected = True
        # Readers may have missed anything while we were away: a fresh snapshot lets them resync.
        self._snapshot_wanted.set()
        return True

    def _disconnect(self) -> None:
        self.connected = False
        for conn in (self._pubsub, self._client):
            if conn is not None:
                with contextlib.suppress(Exception):  # closing a dead connection
                    conn.close()
        self._client = self._pubsub = None

    def _serve(self) -> None:
        """Write heartbeats, batches and snapshots until stopped or Redis fails (raises)."""
        self._write_heartbeat()
        self._up()
        next_heartbeat = time.monotonic() + self.heartbeat_interval
        while not self._stop.is_set():
            self._wake.clear()
            while self._write_some():
                if time.monotonic() >= next_heartbeat or self._heartbeat_due.is_set():
                    break
            self._poll_requests()
            now = time.monotonic()
            if now >= next_heartbeat or self._heartbeat_due.is_set():
                self._heartbeat_due.clear()
                self._write_heartbeat()
                next_heartbeat = now + self.heartbeat_interval
            if not self._buffer:
                self._wake.wait(min(_IDLE_POLL_S, max(next_heartbeat - time.monotonic(), 0.0)))

    def _up(self) -> None:
        """The first write on a new connection went through: the outage, if any, is over."""
        self._backoff = _MIN_BACKOFF_S
        self._logged_down = False
        if self._ever_up:
            self.reconnects += 1
            log.info("kv publisher: reconnected to Redis at %s", redact(self.redis_url))
        self._ever_up = True

    def _poll_requests(self) -> None:
        assert self._pubsub is not None
        while (msg := self._pubsub.get_message(timeout=0)) is not None:
            if msg.get("type") == "message" and msg.get("data") == self.replica_id.encode():
                self._snapshot_wanted.set()

    def _write_heartbeat(self) -> None:
        assert self._client is not None
        silent = self._serving_silent_s()
        if silent is not None:
            if not self._logged_silent:
                log.warning("replica %s: the serving process has been silent for %.1fs (over the heartbeat TTL"
                            " of %.1fs): heartbeats withheld until it speaks again", self.replica_id, silent, self._ttl_s)
                self._logged_silent = True
            return
        if self._logged_silent:
            log.warning("replica %s: the serving process speaks again: heartbeats resume", self.replica_id)
            self._logged_silent = False
        heartbeat = dataclasses.replace(
            self._heartbeat, last_seq=self.last_seq_written, load=self._load, ts=time.time()
        )
        pipe = self._client.pipeline(transaction=True)
        pipe.hset(self._hb_key, mapping=heartbeat.to_redis())
        pipe.pexpire(self._hb_key, self._ttl_ms)
        pipe.execute()

    def _write_some(self) -> bool:
        """Write up to one chunk of buffered items in one MULTI/EXEC; False when nothing was buffered."""
        assert self._client is not None
        with self._lock:
            n = min(len(self._buffer), _WRITE_CHUNK)
            items = [self._buffer.popleft() for _ in range(n)]
            self._num_buffered_batches -= sum(1 for it in items if isinstance(it, _Batch))
        if not items:
            return False
        num_batches = sum(1 for it in items if isinstance(it, _Batch))
        try:
            pipe = self._pipeline(items)
        except Exception:  # noqa: BLE001 - a bad item must not wedge the buffer
            log.exception("kv publisher: could not encode %d buffered items; dropping them", len(items))
            self._dropped_on_write += num_batches
            self._snapshot_wanted.set()
            return True
        try:
            pipe.execute()
        except BaseException as e:
            if isinstance(e, redis.ResponseError) and not isinstance(e, LOST_REDIS_ERRORS):
                # Redis refused the commands (wrong key type, out of memory): retrying would refuse
                # again, so the batches are lost like a buffer overflow and a snapshot will follow.
                # (CLUSTERDOWN, TRYAGAIN, MOVED are ResponseErrors too, of a failover: written again.)
                log.exception("kv publisher: Redis refused %d buffered items; dropping them", len(items))
                self._dropped_on_write += num_batches
                self._snapshot_wanted.set()
                return True
            with self._lock:  # put them back, oldest first, to be written after the reconnect
                self._buffer.extendleft(reversed(items))
                self._num_buffered_batches += num_batches
            raise
        for it in items:
            if isinstance(it, _Batch):
                self.batches_published += 1
                self.events_published += it.num_events
                self.last_seq_written = it.seq
        if any(isinstance(it, CacheSnapshot) for it in items):
            self.snapshots_written += 1
        return True

    def _pipeline(self, items: list[_Batch | CacheSnapshot]) -> redis.client.Pipeline:
        """One MULTI/EXEC writing ``items`` in order (the newest snapshot only: older ones are superseded)."""
        assert self._client is not None
        last_snapshot = next((it for it in reversed(items) if isinstance(it, CacheSnapshot)), None)
        pipe = self._client.pipeline(transaction=True)
        epoch = str(self.epoch)
        for it in items:
            if isinstance(it, _Batch):
                pipe.xadd(
                    self._stream,
                    {F_REPLICA_ID: self.replica_id, F_EPOCH: epoch, F_SEQ: str(it.seq), F_BATCH: it.data},
                    maxlen=self.stream_maxlen,
                    approximate=True,
                )
            elif it is last_snapshot:
                pipe.set(self._snapshot_key, encode_snapshot(it))
        return pipe


__all__ = ["RedisEventPublisher"]
