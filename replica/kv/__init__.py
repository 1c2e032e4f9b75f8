"""Paged KV cache manager with vLLM v1-style prefix caching (DESIGN.md §3.1). No I/O.

Consumes: requests (token ids + extra hash keys) from the scheduler.
Produces: block tables (ids into the model's KV cache), KV events (BlockStored / BlockRemoved /
AllBlocksCleared, in order) for the publisher, usage and prefix-cache stats in tokens.
Guarantees: block 0 is never handed out; ref counts never go negative; every cached digest maps to a
block whose tokens produce it; the events, replayed, reproduce the cached set per medium.

    scheduler ──get_computed_blocks / allocate_slots / free──▶ KVCacheManager ──▶ BlockPool
                                                                   │ take_events()   ├─ FreeKVCacheBlockQueue
                                                                   ▼                 └─ CpuBlockPool (optional)
                                                               publisher

Imports: ``kvroute`` (hashing, event types) and numpy; no torch, no network library.
"""

from replica.kv.block import FreeKVCacheBlockQueue, KVCacheBlock
from replica.kv.block_pool import BlockPool, KVCacheError
from replica.kv.cpu_pool import CpuBlockPool
from replica.kv.manager import ComputedBlocks, KVCacheManager, KVRequest, SimpleKVRequest
from replica.kv.stats import PrefixCacheStats

__all__ = [
    "BlockPool",
    "ComputedBlocks",
    "CpuBlockPool",
    "FreeKVCacheBlockQueue",
    "KVCacheBlock",
    "KVCacheError",
    "KVCacheManager",
    "KVRequest",
    "PrefixCacheStats",
    "SimpleKVRequest",
]
