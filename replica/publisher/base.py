"""The replica's event-publisher interface, its counters, and the implementation that publishes nothing.

The engine's step hook (replica.engine.step_hook) hands every step's KV events and load to one
:class:`EventPublisher`; the replica picks the implementation once at start
(:func:`replica.publisher.make_publisher`): Redis when a URL is configured,
:class:`NullEventPublisher` otherwise. Callers never check for "no publisher".
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvroute.events import KVCacheEvent
from kvroute.heartbeat import EngineLoad

SnapshotFn = Callable[[], Mapping[str, Sequence[int]]]
"""Returns the replica's cached event hashes per medium (``KVCacheManager.cached_event_hashes``)."""


class ReplicaIdInUseError(RuntimeError):
    """A live replica with this replica id heartbeats from another address in the same namespace
    (``replica.publisher.id_check``); the message names the id, both addresses, the namespace and
    what to change."""


@dataclass(frozen=True)
class PublisherStats:
    """A publisher's counters at one moment.

    ``last_seq``: the last batch seq assigned; ``last_seq_written``: the last one Redis acknowledged;
    ``batches_dropped``: batches that never reached Redis (their seqs are gaps in the stream);
    ``connected``: whether the publisher holds a live Redis connection.
    """

    last_seq: int = 0
    batches_published: int = 0
    events_published: int = 0
    batches_dropped: int = 0
    snapshots_written: int = 0
    last_seq_written: int = 0
    reconnects: int = 0
    connected: bool = False


class EventPublisher(abc.ABC):
    """Where one replica's KV events, load and snapshots go (DESIGN.md §3.3, §4).

    ``on_step`` runs on the engine thread after every step (and idle tick): it must not block, do
    network I/O or raise. Everything else may be called from any thread.
    """

    @abc.abstractmethod
    def start(self) -> None:
        """Begin publishing; call once, before the engine runs."""

    @abc.abstractmethod
    def close(self, timeout: float = 2.0) -> None:
        """Stop publishing (best-effort flush within ``timeout`` seconds)."""

    @abc.abstractmethod
    def on_step(self, events: Sequence[KVCacheEvent], load: EngineLoad, snapshot_fn: SnapshotFn) -> None:
        """Queue one engine step's events (possibly none) and its load."""

    @abc.abstractmethod
    def request_snapshot(self) -> None:
        """Ask for a snapshot of the cached set after the next step (the RequestSnapshot rpc)."""

    @abc.abstractmethod
    def start_draining(self) -> None:
        """The replica has begun a graceful stop: from now on its heartbeat says ``draining``, and
        one saying so is written at once (routers must stop picking it before the next period)."""

    @abc.abstractmethod
    def serving_alive(self) -> None:
        """The process serving calls says it is alive (its event loop calls this every half
        heartbeat interval). Once told, a publisher that heartbeats withholds its heartbeats while
        the last word is older than the heartbeat's TTL, so that a replica whose serving process
        is frozen or hung leaves the routers' view (DESIGN.md §3.3). Thread-safe."""

    @abc.abstractmethod
    def stats(self) -> PublisherStats:
        """The counters now."""


class NullEventPublisher(EventPublisher):
    """Publishes nothing: a replica without Redis (tests, a single replica behind no router).
    Events handed to it are dropped; its counters stay at zero."""

    def start(self) -> None:
        pass

    def close(self, timeout: float = 2.0) -> None:
        pass

    def on_step(self, events: Sequence[KVCacheEvent], load: EngineLoad, snapshot_fn: SnapshotFn) -> None:
        pass

    def request_snapshot(self) -> None:
        pass

    def start_draining(self) -> None:
        pass

    def serving_alive(self) -> None:
        pass

    def stats(self) -> PublisherStats:
        return PublisherStats()


__all__ = ["EventPublisher", "NullEventPublisher", "PublisherStats", "ReplicaIdInUseError", "SnapshotFn"]
