"""The event consumer's reads of heartbeats and snapshots (router/consumer.py's thread), made safe
against what anyone who can write to Redis may leave there (DESIGN.md §4, "Hostile input" in
router/consumer_feed.py): a key that is not UTF-8 or of the wrong type (WRONGTYPE) is one
rejected heartbeat or snapshot, reported through ``reject(replica_id, reason, detail)``
(:meth:`router.consumer_feed.IndexFeed.reject`), never an error that would cost the connection
and with it every replica's progress."""

from __future__ import annotations

from collections.abc import Callable

import redis

from kvroute.events import EventDecodeError
from kvroute.redis_connect import LOST_REDIS_ERRORS
from kvroute.redis_layout import RedisLayout
from kvroute.snapshot import SNAPSHOT_HEAD_BYTES, CacheSnapshot, decode_snapshot, snapshot_position

Reject = Callable[[str, str, str], None]


def read_heartbeats(client: redis.Redis, layout: RedisLayout,
                    reject: Reject) -> list[tuple[str, dict, tuple[int, int] | None]]:
    """Every heartbeat hash of ``layout``'s namespace (one pipelined round trip) with its replica's
    snapshot position: ``(replica_id, the HGETALL reply, kvroute.snapshot.snapshot_position of the
    snapshot's head)``. A heartbeat that expired between SCAN and HGETALL is left out.

    Raises:
        kvroute.redis_connect.LOST_REDIS_ERRORS: Redis, or a node of a cluster, is gone (the
            consumer reconnects).
    """
    names: dict[bytes, str] = {}  # heartbeat key -> replica id
    for key in client.scan_iter(match=layout.heartbeat_pattern(), count=1000):
        try:
            found = layout.heartbeat_replica(key.decode())
        except UnicodeDecodeError:
            reject(key.rpartition(b":")[2][:64].decode(errors="replace"), "heartbeat", "a key that is not UTF-8")
            continue
        if found is None:
            continue  # another namespace's key the pattern's '*' let through
        rid, in_its_shard = found
        if in_its_shard:
            names[key] = rid
        else:  # its stream and snapshot would be looked for in another shard than the replica's
            reject(rid[:64], "heartbeat", f"{key.decode()[:128]!r} is not in the replica's event shard "
                                          f"{layout.shard(rid)} of {layout.num_shards}: is event_shards the same?")
    if not names:
        return []
    pipe = client.pipeline(transaction=False)
    for key in names:
        pipe.hgetall(key)
    for rid in names.values():
        pipe.getrange(layout.snapshot_key(rid), 0, SNAPSHOT_HEAD_BYTES - 1)
    results = pipe.execute(raise_on_error=False)  # a WRONGTYPE reply stays in its slot
    # A cluster pipeline also leaves a node's failure in the slots of its commands: that is Redis
    # lost (the consumer reconnects), not a hostile key.
    if lost := next((r for r in results if isinstance(r, LOST_REDIS_ERRORS)), None):
        raise lost
    out = []
    for rid, raw, head in zip(names.values(), results[: len(names)], results[len(names):], strict=True):
        if isinstance(raw, Exception):
            reject(rid[:64], "heartbeat", str(raw))
        elif raw:
            out.append((rid, raw, snapshot_position(head) if isinstance(head, bytes) else None))
    return out


def read_snapshot_position(client: redis.Redis, layout: RedisLayout, rid: str) -> tuple[int, int] | None:
    """(epoch, seq) of ``rid``'s snapshot from its head (a GETRANGE), or None (none, or not one)."""
    try:
        return snapshot_position(client.getrange(layout.snapshot_key(rid), 0, SNAPSHOT_HEAD_BYTES - 1))
    except LOST_REDIS_ERRORS:  # CLUSTERDOWN and the like are ResponseErrors too
        raise
    except redis.ResponseError:  # not a string key: read_snapshot rejects it
        return None


def read_snapshot(client: redis.Redis, layout: RedisLayout, rid: str, reject: Reject) -> CacheSnapshot | None:
    """``rid``'s snapshot, or None when there is none or it is rejected (``snapshot``: it does not
    parse, the key is not a string, or it names another replica)."""
    try:
        data = client.get(layout.snapshot_key(rid))
        if data is None:
            return None
        snap = decode_snapshot(data)
    except LOST_REDIS_ERRORS:
        raise
    except (EventDecodeError, redis.ResponseError) as e:
        reject(rid, "snapshot", f"not a snapshot ({e})")
        return None
    if snap.replica_id != rid:
        reject(rid, "snapshot", f"it names the replica {snap.replica_id[:64]!r}")
        return None
    return snap


__all__ = ["read_heartbeats", "read_snapshot", "read_snapshot_position"]
