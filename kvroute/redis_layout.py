"""The Redis key layout replicas write and routers read (DESIGN.md §4). One place, both sides; one
layout for a single Redis and a Redis Cluster.

Each replica belongs to one event shard ``k = crc32(replica_id) % num_shards``. Every key of a
shard carries the hash tag ``{ns:k}`` (the braces are part of the name), so a Redis Cluster puts
the shard's stream and its replicas' heartbeats and snapshots in one hash slot: the publisher's
MULTI/EXEC (batches and snapshot) never spans two slots, and the shards spread over the nodes.

    kvroute:{ns:k}:events               stream, one entry per engine step:
                                        {replica_id, epoch, seq, batch = KVEventBatch bytes}
    kvroute:{ns:k}:replica:{replica_id}  hash with TTL ~3 heartbeats: identity + load
                                        (its fields: kvroute.heartbeat.Heartbeat, FIELDS)
    kvroute:{ns:k}:snapshot:{replica_id} CacheSnapshot bytes (the cached set per medium at a seq)
    kvroute:{ns:k}:snapshot-requests    pub/sub channel: a replica_id asks that replica for a snapshot
    kvroute:ns:router-load:{router}     hash with TTL: that router's in-flight load per replica
                                        (no tag: one key per command; SCAN reads every node)

Here ``{ns:k}`` is literal: ``kvroute:{default:0}:events``; ``{replica_id}`` and ``{router}``
stand for the id.
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass

DEFAULT_NAMESPACE = "default"

# Fields of a stream entry.
F_REPLICA_ID = b"replica_id"
F_EPOCH = b"epoch"
F_SEQ = b"seq"
F_BATCH = b"batch"


def _glob_escape(text: str) -> str:
    """``text`` matched literally in a SCAN MATCH pattern (a namespace may hold ``*?[]\\``)."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


@dataclass(frozen=True)
class RedisLayout:
    """Key names for one namespace; ``num_shards > 1`` spreads replicas over several streams (and,
    on a Redis Cluster, over several hash slots)."""

    namespace: str = DEFAULT_NAMESPACE
    num_shards: int = 1

    def __post_init__(self) -> None:
        if not self.namespace or any(c in self.namespace for c in " :{}"):
            raise ValueError(f"namespace: must be non-empty without spaces, ':' or braces, got {self.namespace!r}")
        if self.num_shards < 1:
            raise ValueError(f"event_shards: must be >= 1, got {self.num_shards}")

    def shard(self, replica_id: str) -> int:
        """The event shard of ``replica_id`` (a stable hash of the id)."""
        return zlib.crc32(replica_id.encode()) % self.num_shards

    def _tagged(self, shard: int) -> str:
        # A namespace has no ':', so the tag's ':' ends it: "{a:0}" is never namespace "a:0"'s.
        return f"kvroute:{{{self.namespace}:{shard}}}"

    def events_stream(self, replica_id: str) -> str:
        """The stream a replica appends to: its shard's."""
        return f"{self._tagged(self.shard(replica_id))}:events"

    def all_event_streams(self) -> list[str]:
        """Every shard's stream, in shard order."""
        return [f"{self._tagged(k)}:events" for k in range(self.num_shards)]

    def heartbeat_key(self, replica_id: str) -> str:
        return f"{self._tagged(self.shard(replica_id))}:replica:{replica_id}"

    def heartbeat_pattern(self) -> str:
        """A SCAN MATCH pattern for every heartbeat key of the namespace (and maybe more: a
        hostile key can match it; :meth:`heartbeat_replica` tells)."""
        return f"kvroute:{{{_glob_escape(self.namespace)}:*}}:replica:*"

    def heartbeat_replica(self, key: str) -> tuple[str, bool] | None:
        """For a key :meth:`heartbeat_pattern` matched: ``(replica_id, in_its_shard)``, where
        ``in_its_shard`` is False for a key under another shard than the id's (a replica with
        another ``event_shards``); None when the key is not a heartbeat key of this namespace."""
        m = re.fullmatch(rf"kvroute:\{{{re.escape(self.namespace)}:(\d+)\}}:replica:(.+)", key, re.DOTALL)
        if m is None:
            return None
        rid = m.group(2)
        return rid, m.group(1) == str(self.shard(rid))

    def snapshot_key(self, replica_id: str) -> str:
        return f"{self._tagged(self.shard(replica_id))}:snapshot:{replica_id}"

    def snapshot_requests_channel(self, replica_id: str) -> str:
        """The channel ``replica_id``'s snapshot requests go to: its shard's (a PUBLISH reaches
        every node of a cluster; a subscriber listens on its own shard's node)."""
        return f"{self._tagged(self.shard(replica_id))}:snapshot-requests"

    def router_load_key(self, router_id: str) -> str:
        """Hash ``replica_id -> "in_flight,pending_prefill_tokens"`` of one router, with a TTL."""
        return f"kvroute:{self.namespace}:router-load:{router_id}"

    def router_load_pattern(self) -> str:
        return f"kvroute:{_glob_escape(self.namespace)}:router-load:*"
