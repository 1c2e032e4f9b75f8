"""Sharing what routers route through Redis (DESIGN.md §5): each router publishes its
:class:`router.load.RouterShare` (its own per-replica in-flight load and its speculative index
entries the KV events have not brought yet) under a key with a TTL and merges the other routers'
(``router.core.Router.share`` / ``merge``), every ``interval`` seconds, on its own thread.

Redis layout: one hash per router, ``layout.router_load_key(router_id)``, field replica id, value
``in_flight,pending_prefill_tokens`` and, when that router holds speculative entries on the
replica, ``,`` and their hashes as big-endian unsigned 64-bit ints (8 bytes each, the event ints).

The delay: a router's change is in Redis at its next sync, at most ``interval`` + one round trip
later, and in another router's view at that router's next sync after it, so at most two intervals
and two round trips after the change (0.4 s with the default 0.2 s interval).
"""

from __future__ import annotations

import contextlib
import logging
import struct
import threading

import redis

from kvroute.redis_connect import LOST_REDIS_ERRORS, RedisAuth, connect
from kvroute.redis_layout import RedisLayout
from router.core import Router
from router.load import RouterShare

log = logging.getLogger(__name__)


def encode_share(share: RouterShare) -> dict[str, bytes]:
    """``share`` as the fields of its router's hash (module docstring)."""
    out = {}
    for rid in share.load.keys() | share.speculative.keys():
        f, p = share.load.get(rid, (0, 0))
        value = b"%d,%d" % (f, p)
        hashes = share.speculative.get(rid)
        if hashes:
            value += b"," + struct.pack(f">{len(hashes)}Q", *hashes)
        out[rid] = value
    return out


def decode_share(raw: dict[bytes, bytes]) -> tuple[RouterShare, int]:
    """A router's hash as its share, and how many fields did not parse (left out: anyone who can
    write to Redis can write there, and one bad field must not hide the rest)."""
    share = RouterShare()
    bad = 0
    for field, value in raw.items():
        try:
            rid = field.decode()
            f, p, *rest = value.split(b",", 2)
            load = (int(f), int(p))
            packed = rest[0] if rest else b""
            hashes = struct.unpack(f">{len(packed) // 8}Q", packed) if packed else ()
        except (ValueError, struct.error):  # UnicodeDecodeError is a ValueError
            bad += 1
            continue
        share.load[rid] = load
        if hashes:
            share.speculative[rid] = hashes
    return share, bad


class RedisLoadSync:
    """Publishes this router's share to Redis and merges the other routers', every ``interval`` s.

    Keys expire after ``ttl`` seconds, so a router that dies stops counting on its own.
    """

    def __init__(
        self, redis_url: str, layout: RedisLayout, router_id: str, router: Router,
        interval: float = 0.2, ttl: float = 3.0, auth: RedisAuth | None = None,
    ):
        self.redis_url = redis_url
        self.auth = auth
        self._redis: redis.Redis | None = None  # made on the thread: a cluster's client connects when made
        self.layout = layout
        self.router_id = router_id
        self.router = router
        self.interval = interval
        self.ttl_ms = int(ttl * 1000)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="router-load-sync", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)
        if self._redis is not None:
            with contextlib.suppress(redis.RedisError, *LOST_REDIS_ERRORS):
                self._redis.delete(self.layout.router_load_key(self.router_id))
            self._redis.close()

    def sync_once(self) -> None:
        if self._redis is None:
            self._redis = connect(self.redis_url, self.auth, socket_timeout=2, socket_connect_timeout=1)
        client = self._redis
        own_key = self.layout.router_load_key(self.router_id)
        fields = encode_share(self.router.share())
        # One MULTI/EXEC (one key: one slot on a cluster), so no reader sees the key deleted and not
        # yet written again, and drops this router's share for an interval.
        pipe = client.pipeline(transaction=True)
        pipe.delete(own_key)
        if fields:
            pipe.hset(own_key, mapping=fields)
            pipe.pexpire(own_key, self.ttl_ms)
        pipe.execute()
        seen = set()
        for key in client.scan_iter(match=self.layout.router_load_pattern(), count=100):  # every primary of a cluster
            k = key.decode()
            if k == own_key:
                continue
            other = k.rsplit(":", 1)[-1]
            seen.add(other)
            share, bad = decode_share(client.hgetall(key))
            if bad:
                log.debug("router load sync: %d field(s) of %s do not parse", bad, k)
            self.router.merge(other, share)
        for other in self.router.load.remote_routers():
            if other not in seen:
                self.router.merge(other, None)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sync_once()
            except (redis.RedisError, ValueError, *LOST_REDIS_ERRORS) as e:  # a failover too: next interval
                log.debug("router load sync failed: %s", e)


__all__ = ["RedisLoadSync", "decode_share", "encode_share"]
