"""The Redis key layout replicas write and routers read (DESIGN.md §4). One place, both sides.

    kvroute:{ns}:events[:{shard}]     stream, one entry per engine step:
                                      {replica_id, epoch, seq, batch = KVEventBatch bytes}
    kvroute:{ns}:replica:{replica_id} hash with TTL ~3 heartbeats: identity + load
                                      (its fields: kvroute.heartbeat.Heartbeat, FIELDS)
    kvroute:{ns}:snapshot:{replica_id} CacheSnapshot bytes (the cached set per medium at a seq)
    kvroute:{ns}:snapshot-requests    pub/sub channel: a replica_id asks that replica for a snapshot
    kvroute:{ns}:router-load:{router} hash with TTL: that router's in-flight load per replica
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

DEFAULT_NAMESPACE = "default"

# Fields of a stream entry.
F_REPLICA_ID = b"replica_id"
F_EPOCH = b"epoch"
F_SEQ = b"seq"
F_BATCH = b"batch"


@dataclass(frozen=True)
class RedisLayout:
    """Key names for one namespace; ``num_shards > 1`` spreads replicas over several streams."""

    namespace: str = DEFAULT_NAMESPACE
    num_shards: int = 1

    def __post_init__(self) -> None:
        if not self.namespace or any(c in self.namespace for c in " :{}"):
            raise ValueError(f"namespace: must be non-empty without spaces, ':' or braces, got {self.namespace!r}")
        if self.num_shards < 1:
            raise ValueError(f"event_shards: must be >= 1, got {self.num_shards}")

    @property
    def prefix(self) -> str:
        return f"kvroute:{self.namespace}"

    def events_stream(self, replica_id: str) -> str:
        """The stream a replica appends to (a stable shard of its id when sharded)."""
        if self.num_shards == 1:
            return f"{self.prefix}:events"
        return f"{self.prefix}:events:{zlib.crc32(replica_id.encode()) % self.num_shards}"

    def all_event_streams(self) -> list[str]:
        if self.num_shards == 1:
            return [f"{self.prefix}:events"]
        return [f"{self.prefix}:events:{k}" for k in range(self.num_shards)]

    def heartbeat_key(self, replica_id: str) -> str:
        return f"{self.prefix}:replica:{replica_id}"

    def heartbeat_pattern(self) -> str:
        return f"{self.prefix}:replica:*"

    def snapshot_key(self, replica_id: str) -> str:
        return f"{self.prefix}:snapshot:{replica_id}"

    def snapshot_requests_channel(self) -> str:
        return f"{self.prefix}:snapshot-requests"

    def router_load_key(self, router_id: str) -> str:
        """Hash ``replica_id -> "in_flight,pending_prefill_tokens"`` of one router, with a TTL."""
        return f"{self.prefix}:router-load:{router_id}"

    def router_load_pattern(self) -> str:
        return f"{self.prefix}:router-load:*"
