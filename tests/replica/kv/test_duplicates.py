"""Duplicate cached blocks (DESIGN.md §3.1): the same hash may live in two physical blocks.

Block tables are append-only, so a request that recomputes a block another running request already
cached keeps its own copy; both copies are registered and both are announced.
"""

from __future__ import annotations

from collections import Counter

from kvroute.events import GPU, BlockRemoved, BlockStored
from replica.kv import KVCacheManager, SimpleKVRequest
from tests.replica.kv._reference import ref_event_ints

B = 4
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]


H0, H1 = ref_event_ints(PROMPT, B)
OTHER = list(range(100, 116))  # 16 unrelated tokens: 4 full blocks
C = ref_event_ints(OTHER, B)


def admit(mgr, req):
    computed = mgr.get_computed_blocks(req)
    n = computed.num_computed_tokens
    assert mgr.allocate_slots(req, req.num_tokens - n, n, computed) is not None
    req.num_computed_tokens = req.num_tokens
    return computed


def free_queue(mgr):
    return [b.block_id for b in mgr.block_pool.free_block_queue.get_all_free_blocks()]


def test_same_prompt_twice_caches_the_last_block_twice_and_survives_evicting_one_copy():
    mgr = KVCacheManager(num_blocks=7, block_size=B)  # 6 usable blocks, default (lru) free order
    a = SimpleKVRequest("a", list(PROMPT))
    assert admit(mgr, a).blocks == []
    assert mgr.get_block_ids("a") == [1, 2]
    assert mgr.take_events() == [BlockStored((H0, H1), None, tuple(PROMPT), B)]

    # The second copy: at most (8 - 1) // 4 = 1 block is looked up (the last token is recomputed).
    b = SimpleKVRequest("b", list(PROMPT))
    computed = admit(mgr, b)
    assert [blk.block_id for blk in computed.blocks] == [1]
    assert computed.num_computed_tokens == 4
    assert mgr.get_block_ids("b") == [1, 3]
    # block 1 of the prompt is cached a second time, in block 3, and announced again
    assert mgr.take_events() == [BlockStored((H1,), H0, (5, 6, 7, 8), B)]
    assert mgr.block_pool.blocks[2].event_hash == mgr.block_pool.blocks[3].event_hash == H1
    assert Counter(mgr.cached_event_hashes()[GPU]) == Counter({H0: 1, H1: 2})
    assert [mgr.block_pool.blocks[i].ref_cnt for i in (1, 2, 3)] == [2, 1, 1]
    assert mgr.stats.hits == 4 and mgr.stats.queries == 16

    mgr.free(a)
    mgr.free(b)
    assert free_queue(mgr) == [4, 5, 6, 2, 3, 1]

    # Force eviction of exactly one copy: 4 new blocks take 4, 5, 6 and then block 2 (a's copy).
    c = SimpleKVRequest("c", list(OTHER))
    assert admit(mgr, c).blocks == []
    assert mgr.get_block_ids("c") == [4, 5, 6, 2]
    assert mgr.take_events() == [BlockRemoved((H1,)), BlockStored(tuple(C), None, tuple(OTHER), B)]
    assert Counter(mgr.cached_event_hashes()[GPU]) == Counter({H0: 1, H1: 1, **{h: 1 for h in C}})
    mgr.free(c)

    # The surviving copy (block 3) still serves the prefix: [1..8, 9] hits 8 tokens.
    d = SimpleKVRequest("d", [*PROMPT, 9])
    computed = admit(mgr, d)
    assert [blk.block_id for blk in computed.blocks] == [1, 3]
    assert computed.num_computed_tokens == 8
    assert mgr.get_block_ids("d")[:2] == [1, 3]
    assert mgr.stats.hits == 12


def test_get_computed_blocks_prefers_the_first_registered_copy_while_both_exist():
    mgr = KVCacheManager(num_blocks=7, block_size=B)
    a, b = SimpleKVRequest("a", list(PROMPT)), SimpleKVRequest("b", list(PROMPT))
    admit(mgr, a)
    admit(mgr, b)
    d = SimpleKVRequest("d", [*PROMPT, 9])
    assert [blk.block_id for blk in mgr.get_computed_blocks(d).blocks] == [1, 2]
