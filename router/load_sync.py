"""Sharing the routers' load through Redis (DESIGN.md §5): each router publishes its own
per-replica counts (``router.load.LoadTracker.local``) under a key with a TTL and merges the other
routers' into its tracker (``set_remote``), every ``interval`` seconds, on its own thread.

Redis layout: one hash per router, ``layout.router_load_key(router_id)``, field replica id, value
``"in_flight,pending_prefill_tokens"``.
"""

from __future__ import annotations

import contextlib
import logging
import threading

import redis

from kvroute.redis_connect import RedisAuth, connect
from kvroute.redis_layout import RedisLayout
from router.load import LoadTracker

log = logging.getLogger(__name__)


class RedisLoadSync:
    """Publishes this router's load to Redis and reads the other routers', every ``interval`` s.

    Keys expire after ``ttl`` seconds, so a router that dies stops counting on its own.
    """

    def __init__(
        self, redis_url: str, layout: RedisLayout, router_id: str, tracker: LoadTracker,
        interval: float = 0.2, ttl: float = 3.0, auth: RedisAuth | None = None,
    ):
        self._redis = connect(redis_url, auth, socket_timeout=2, socket_connect_timeout=1)
        self.layout = layout
        self.router_id = router_id
        self.tracker = tracker
        self.interval = interval
        self.ttl_ms = int(ttl * 1000)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="router-load-sync", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)
        with contextlib.suppress(redis.RedisError):
            self._redis.delete(self.layout.router_load_key(self.router_id))
        self._redis.close()

    def sync_once(self) -> None:
        own_key = self.layout.router_load_key(self.router_id)
        local = self.tracker.local()
        pipe = self._redis.pipeline()
        pipe.delete(own_key)
        if local:
            pipe.hset(own_key, mapping={r: f"{f},{p}" for r, (f, p) in local.items()})
            pipe.pexpire(own_key, self.ttl_ms)
        pipe.execute()
        seen = set()
        for key in self._redis.scan_iter(match=self.layout.router_load_pattern(), count=100):
            k = key.decode()
            if k == own_key:
                continue
            other = k.rsplit(":", 1)[-1]
            seen.add(other)
            raw = self._redis.hgetall(key)
            counts = {}
            for r, v in raw.items():
                f, p = v.decode().split(",")
                counts[r.decode()] = (int(f), int(p))
            self.tracker.set_remote(other, counts)
        for other in self.tracker.remote_routers():
            if other not in seen:
                self.tracker.set_remote(other, None)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sync_once()
            except (redis.RedisError, ValueError) as e:
                log.debug("router load sync failed: %s", e)


__all__ = ["RedisLoadSync"]
