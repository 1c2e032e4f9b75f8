"""The simulated replicas' KV events reach the router's index through the live consumer's apply
path (``router.consumer_feed.IndexFeed``): replayed, they reproduce the manager's cached set,
evictions and clears included."""

from __future__ import annotations

import threading

from kvroute.hashing import BlockHasher
from kvroute_tools.simulate.cluster import step_batch
from replica.kv import KVCacheManager, SimpleKVRequest
from router.consumer_feed import IndexFeed
from router.index import BlockIndex
from router.registry import ReplicaRegistry


def test_the_index_ends_up_with_the_managers_cached_set():
    hasher = BlockHasher(block_size=4)
    kv = KVCacheManager(9, 4, hasher)  # 8 usable blocks: the third prompt evicts
    index = BlockIndex(speculative_ttl=0)
    feed = IndexFeed(index, ReplicaRegistry(hasher.identity, "redis"), threading.Lock())
    seq = 0
    for i, base in enumerate((0, 100, 200)):
        req = SimpleKVRequest(f"r{i}", [base + t for t in range(12)])
        hit = kv.get_computed_blocks(req)
        assert kv.allocate_slots(req, 12 - hit.num_computed_tokens, hit.num_computed_tokens, hit) is not None
        kv.free(req)
        seq += 1
        feed.entry("a", 1, seq, step_batch(kv.take_events(), float(i)), history=False)
        assert index.cached_set("a") == {h: kv.cached_event_hashes()["GPU"].count(h)
                                         for h in kv.cached_event_hashes()["GPU"]}
    assert index.num_entries("a") == 8  # 9 blocks stored, 1 evicted
    assert feed.batches_applied == 3 and feed.gaps == 0
    assert kv.reset_prefix_cache()
    feed.entry("a", 1, seq + 1, step_batch(kv.take_events(), 3.0), history=False)
    assert index.num_entries("a") == 0
