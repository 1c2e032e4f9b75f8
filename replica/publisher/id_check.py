"""Refuse a replica id that a live replica elsewhere already heartbeats under (DESIGN.md §4).

Two clusters pointed at one Redis namespace with the same replica ids (``kvroute up`` names its
replicas replica-0, replica-1, ...) would write one heartbeat key, one event stream and one
snapshot key per id: routers then send traffic to the other cluster's replica and lose their
index. So a starting replica reads the heartbeat key of its id first::

    no key, or the same address (our own restart) ──▶ start
    another address ──▶ watch the key for its remaining TTL (at most 3 heartbeats):
        refreshed ──▶ ReplicaIdInUseError (a live replica: refuse to start)
        gone, or never refreshed ──▶ start (a dead replica's last heartbeat)
"""

from __future__ import annotations

import logging
import time

import redis

from kvroute.heartbeat import Heartbeat
from kvroute.redis_connect import LOST_REDIS_ERRORS, RedisAuth, connect, describe_error
from kvroute.redis_layout import RedisLayout
from replica.publisher.base import ReplicaIdInUseError

log = logging.getLogger(__name__)

_POLL_S = 0.05
_NO_TTL_WAIT_S = 3.0  # a key without a TTL (not written by a publisher): watch it this long


def check_replica_id_free(client: redis.Redis, layout: RedisLayout, replica_id: str, address: str) -> None:
    """Return when no *live* replica other than one at ``address`` heartbeats as ``replica_id``.

    Blocks for up to the other heartbeat's remaining TTL while it decides whether that heartbeat
    is still refreshed.

    Raises:
        ReplicaIdInUseError: the heartbeat of ``replica_id`` names another address and is refreshed.
        redis.RedisError: Redis cannot be read.
    """
    key = layout.heartbeat_key(replica_id)
    first = client.hgetall(key)
    if not first:
        return
    try:
        other = Heartbeat.from_redis(first).address
    except ValueError:  # a record that names nobody: not a replica's heartbeat
        return
    if other == address:
        return
    ttl_ms = client.pttl(key)
    deadline = time.monotonic() + (ttl_ms / 1000 if ttl_ms > 0 else _NO_TTL_WAIT_S)
    while time.monotonic() < deadline:
        time.sleep(_POLL_S)
        now = client.hgetall(key)
        if not now:
            return  # expired: a dead replica's last heartbeat
        if now != first:
            raise ReplicaIdInUseError(
                f"replica_id {replica_id!r} is in use: a live replica at {other} heartbeats under it in"
                f" namespace {layout.namespace!r} (this replica would serve at {address}). Give this one"
                " another --replica-id, or its cluster another --namespace (two clusters on one Redis"
                " namespace must not share replica ids)"
            )
    log.info("replica %s: the heartbeat of %s at %s was not refreshed; taking over the id", replica_id,
             replica_id, other)


def claim_replica_id(
    redis_url: str, layout: RedisLayout, replica_id: str, address: str, auth: RedisAuth | None = None,
) -> None:
    """:func:`check_replica_id_free` on a connection of its own. Redis down is not an error here
    (the publisher waits for Redis anyway): logged, and the replica starts.

    Raises:
        ReplicaIdInUseError: as :func:`check_replica_id_free`.
    """
    client = None
    try:
        client = connect(redis_url, auth, socket_connect_timeout=2.0, socket_timeout=5.0)  # a cluster's: connects
        check_replica_id_free(client, layout, replica_id, address)
    except (redis.RedisError, *LOST_REDIS_ERRORS) as e:
        log.warning("replica %s: cannot check Redis for another replica with this id (%s)", replica_id,
                    describe_error(redis_url, e))
    finally:
        if client is not None:
            client.close()


__all__ = ["check_replica_id_free", "claim_replica_id"]
