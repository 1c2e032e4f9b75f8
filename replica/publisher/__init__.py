"""Where a replica's KV events, load heartbeats and cache snapshots go (DESIGN.md §3.3, §4).

Consumes: each engine step's KV events and :class:`kvroute.heartbeat.EngineLoad` (on the thread
that steps the engine: in the engine process by default, so events leave from next to the engine),
snapshot requests. Produces: with Redis, the replica's event stream, heartbeat and
snapshot keys (kvroute.redis_layout); without, nothing. May import ``kvroute`` and redis-py only.

- :class:`EventPublisher`: the interface the step hook calls; :class:`PublisherStats` its counters.
- :class:`RedisEventPublisher`: the Redis writer (``redis_publisher``).
- :class:`NullEventPublisher`: publishes nothing.
- :func:`make_publisher`: the one place that picks.
- :func:`id_check.claim_replica_id`: at start, refuse an id a live replica elsewhere heartbeats under
  (:class:`ReplicaIdInUseError`).
"""

from __future__ import annotations

from kvroute.engine_info import EngineInfo
from kvroute.redis_layout import RedisLayout
from replica.publisher.base import (
    EventPublisher,
    NullEventPublisher,
    PublisherStats,
    ReplicaIdInUseError,
    SnapshotFn,
)


def make_publisher(
    redis_url: str, layout: RedisLayout, replica_id: str, info: EngineInfo, address: str, **options
) -> EventPublisher:
    """A :class:`RedisEventPublisher` when ``redis_url`` is set (``options`` are its keyword
    arguments), else a :class:`NullEventPublisher`. Not started."""
    if not redis_url:
        return NullEventPublisher()
    from replica.publisher.redis_publisher import RedisEventPublisher

    return RedisEventPublisher(redis_url, layout, replica_id, info, address, **options)


def __getattr__(name: str):
    # RedisEventPublisher is imported on first use: a replica without Redis never loads redis-py's client.
    if name == "RedisEventPublisher":
        from replica.publisher.redis_publisher import RedisEventPublisher

        return RedisEventPublisher
    raise AttributeError(name)


__all__ = [
    "EventPublisher", "NullEventPublisher", "PublisherStats", "RedisEventPublisher", "ReplicaIdInUseError", "SnapshotFn",
    "make_publisher",
]
