"""The adapter hands a KV manager's events to the router's index: replayed, they reproduce the
manager's cached set, evictions and clears included."""

from __future__ import annotations

from kvroute.hashing import BlockHasher
from kvroute_tools.simulate.adapter import apply_events
from replica.kv import KVCacheManager, SimpleKVRequest
from router.index import BlockIndex


def test_the_index_ends_up_with_the_managers_cached_set():
    kv = KVCacheManager(9, 4, BlockHasher(block_size=4))  # 8 usable blocks: the third prompt evicts
    index = BlockIndex(speculative_ttl=0)
    for i, base in enumerate((0, 100, 200)):
        req = SimpleKVRequest(f"r{i}", [base + t for t in range(12)])
        hit = kv.get_computed_blocks(req)
        assert kv.allocate_slots(req, 12 - hit.num_computed_tokens, hit.num_computed_tokens, hit) is not None
        kv.free(req)
        apply_events(index, "a", kv.take_events())
        assert index.cached_set("a") == {h: kv.cached_event_hashes()["GPU"].count(h)
                                         for h in kv.cached_event_hashes()["GPU"]}
    assert index.num_entries("a") == 8  # 9 blocks stored, 1 evicted
    assert kv.reset_prefix_cache()
    apply_events(index, "a", kv.take_events())
    assert index.num_entries("a") == 0
