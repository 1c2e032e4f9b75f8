"""The one place the simulated replicas' KV events reach the router's index.

The live router decodes each ``KVEventBatch`` from Redis and applies its events to the index
(``router.consumer``: BlockStored -> ``index.add``, BlockRemoved -> ``index.remove``,
AllBlocksCleared -> ``index.clear_replica``, each with the event's whole hash list). The
simulator skips Redis and protobuf and hands the KV manager's event objects to this function, which
makes the same calls; point it at the consumer's apply path once that takes decoded events.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvroute.events import MEDIA, AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from router.index import BlockIndex


def apply_events(index: BlockIndex, replica_id: str, events: Iterable[KVCacheEvent]) -> int:
    """Apply one replica's events, in order, to ``index``; returns the number of block hashes."""
    blocks = 0
    for ev in events:
        if isinstance(ev, BlockStored):
            if ev.medium in MEDIA:
                index.add(replica_id, ev.block_hashes, ev.medium)
                blocks += len(ev.block_hashes)
        elif isinstance(ev, BlockRemoved):
            if ev.medium in MEDIA:
                index.remove(replica_id, ev.block_hashes, ev.medium)
                blocks += len(ev.block_hashes)
        elif isinstance(ev, AllBlocksCleared) and (ev.medium is None or ev.medium in MEDIA):
            index.clear_replica(replica_id, ev.medium)
    return blocks


__all__ = ["apply_events"]
