"""DESIGN.md §3.1, the design-doc example, step by step, in both free orders.

    Design-doc example (block_size 4, 10 usable blocks, ids as in the doc, free_order="fifo"):
    req0 = 15 prompt tokens -> table [0,1,2,3], cached {0,1,2}; a decode step fills block 3 (cached),
    the next needs block 4. req1 = 14 tokens, first 10 equal to req0 -> hits blocks 0,1 only (8
    tokens), table [0,1,5,6]. Free req0 -> free queue [7,8,9,4,3,2]. Free req1 ->
    [7,8,9,4,3,2,6,5,1,0]. req2 = 29 tokens, first 12 equal to req0 -> hits 0,1,2; new blocks
    7,8,9,4,3 with 3 evicted (BlockRemoved before the BlockStored of that step); free queue [6,5].
    Totals: queries 58 tokens, hits 20. With the default free order the same script evicts nothing
    at req2 (new blocks 6,4,7,8,9).

Our block 0 is the null block, so our ids are the doc's + 1 (num_blocks=11). Expected values below
are written in doc ids and shifted by ``ours``. Hashes are recomputed here from the definition.
"""

from __future__ import annotations

import pytest

from kvroute.events import BlockRemoved, BlockStored
from replica.kv import KVCacheManager, SimpleKVRequest
from tests.replica.kv._reference import ref_event_ints

B = 4


def ours(doc_ids):
    return [i + 1 for i in doc_ids]


def chain(tokens):
    """Reference digests of the full blocks (DESIGN §2, no extra keys), as event ints."""
    return ref_event_ints(tokens, B)


REQ0 = list(range(1, 16))  # 15 prompt tokens
DECODE = [100, 101]  # the two decode tokens of req0
REQ1 = REQ0[:10] + [201, 202, 203, 204]  # 14 tokens, first 10 equal to req0
REQ2 = REQ0[:12] + list(range(301, 318))  # 29 tokens, first 12 equal to req0
H0 = chain(REQ0 + DECODE)  # req0's 4 full blocks (the 4th after the first decode step)
H1 = chain(REQ1)  # req1's 3 full blocks: blocks 0,1 shared with req0
H2 = chain(REQ2)  # req2's 7 full blocks: blocks 0..2 shared with req0


def free_queue(mgr):
    return [b.block_id for b in mgr.block_pool.free_block_queue.get_all_free_blocks()]


def cached(mgr):
    """block id -> event int of every block that holds a hash."""
    return {b.block_id: b.event_hash for b in mgr.block_pool.blocks if b.block_hash is not None}


def admit(mgr, req):
    computed = mgr.get_computed_blocks(req)
    new = mgr.allocate_slots(
        req, req.num_tokens - computed.num_computed_tokens, computed.num_computed_tokens, computed
    )
    assert new is not None
    req.num_computed_tokens = req.num_tokens
    return computed


def decode(mgr, req, token):
    req.append_output_token_ids(token)
    assert mgr.allocate_slots(req, 1) is not None
    req.num_computed_tokens += 1


def test_reference_chains_share_the_prefixes_the_doc_says():
    assert H1[:2] == H0[:2] and H1[2] != H0[2]
    assert H2[:3] == H0[:3] and H2[3] != H0[3]


# Per free order, in doc ids: free queue after "free req0", after "free req1", req2's new blocks, and
# the free queue after req2.
FIFO = ([7, 8, 9, 4, 3, 2], [7, 8, 9, 4, 3, 2, 6, 5, 1, 0], [7, 8, 9, 4, 3], [6, 5])
LRU = ([4, 7, 8, 9, 3, 2], [6, 4, 7, 8, 9, 3, 2, 5, 1, 0], [6, 4, 7, 8, 9], [3, 5])


@pytest.mark.parametrize("free_order, expected", [("fifo", FIFO), ("lru", LRU)], ids=["fifo", "lru"])
def test_design_doc_example(free_order, expected):
    after_free0, after_free1, req2_new, after_req2 = expected
    kwargs = {} if free_order == "lru" else {"free_order": "fifo"}
    mgr = KVCacheManager(num_blocks=11, block_size=B, **kwargs)
    assert mgr.block_pool.free_order == free_order  # lru is the default
    assert free_queue(mgr) == ours(range(10))

    # req0 = 15 prompt tokens -> table [0,1,2,3], cached {0,1,2}
    req0 = SimpleKVRequest("req0", list(REQ0))
    computed = admit(mgr, req0)
    assert computed.blocks == [] and computed.num_computed_tokens == 0
    assert mgr.get_block_ids("req0") == ours([0, 1, 2, 3])
    assert cached(mgr) == dict(zip(ours([0, 1, 2]), H0[:3], strict=True))
    assert mgr.take_events() == [BlockStored(tuple(H0[:3]), None, tuple(REQ0[:12]), B)]
    assert mgr.usage == pytest.approx(0.4)

    # a decode step fills block 3 (cached) ...
    decode(mgr, req0, DECODE[0])
    assert mgr.get_block_ids("req0") == ours([0, 1, 2, 3])
    assert cached(mgr) == dict(zip(ours([0, 1, 2, 3]), H0, strict=True))
    assert mgr.take_events() == [BlockStored((H0[3],), H0[2], (13, 14, 15, 100), B)]
    # ... the next needs block 4
    decode(mgr, req0, DECODE[1])
    assert mgr.get_block_ids("req0") == ours([0, 1, 2, 3, 4])
    assert mgr.take_events() == []
    assert free_queue(mgr) == ours([5, 6, 7, 8, 9])

    # req1 = 14 tokens, first 10 equal to req0 -> hits blocks 0,1 only (8 tokens), table [0,1,5,6]
    req1 = SimpleKVRequest("req1", list(REQ1))
    computed = admit(mgr, req1)
    assert [b.block_id for b in computed.blocks] == ours([0, 1])
    assert computed.num_computed_tokens == 8
    assert mgr.get_block_ids("req1") == ours([0, 1, 5, 6])
    # req1's third block is full: cached in doc block 5; doc block 6 holds 2 tokens, uncached
    assert cached(mgr) == {**dict(zip(ours([0, 1, 2, 3]), H0, strict=True)), ours([5])[0]: H1[2]}
    assert mgr.take_events() == [BlockStored((H1[2],), H1[1], (9, 10, 201, 202), B)]
    assert [mgr.block_pool.blocks[i].ref_cnt for i in ours([0, 1, 2, 3, 4, 5, 6])] == [2, 2, 1, 1, 1, 1, 1]

    # Free req0 -> free queue [7,8,9,4,3,2] (fifo)
    mgr.free(req0)
    assert free_queue(mgr) == ours(after_free0)
    # Free req1 -> [7,8,9,4,3,2,6,5,1,0] (fifo)
    mgr.free(req1)
    assert free_queue(mgr) == ours(after_free1)
    assert mgr.usage == 0.0
    assert mgr.take_events() == []  # freeing keeps blocks cached
    cached_before_req2 = cached(mgr)
    assert set(cached_before_req2) == set(ours([0, 1, 2, 3, 5]))

    # req2 = 29 tokens, first 12 equal to req0 -> hits 0,1,2
    req2 = SimpleKVRequest("req2", list(REQ2))
    computed = admit(mgr, req2)
    assert [b.block_id for b in computed.blocks] == ours([0, 1, 2])
    table = mgr.get_block_ids("req2")
    assert table == ours([0, 1, 2, *req2_new])
    assert free_queue(mgr) == ours(after_req2)
    # full blocks 3..6 of req2 are the 4 new blocks after the hits; the 8th holds one token
    stored = BlockStored(tuple(H2[3:7]), H2[2], tuple(REQ2[12:28]), B)
    new_cached = dict(zip(table[3:7], H2[3:7], strict=True))
    if free_order == "fifo":
        # new blocks 7,8,9,4,3 with 3 evicted: BlockRemoved before the BlockStored of that step
        assert mgr.take_events() == [BlockRemoved((H0[3],)), stored]
        expected_cached = {k: v for k, v in cached_before_req2.items() if k != ours([3])[0]}
    else:
        # the default free order evicts nothing: new blocks 6,4,7,8,9
        assert mgr.take_events() == [stored]
        expected_cached = dict(cached_before_req2)
    assert cached(mgr) == {**expected_cached, **new_cached}

    # Totals: queries 58 tokens, hits 20
    assert mgr.stats.queries == 58
    assert mgr.stats.hits == 20
    assert mgr.stats.requests == 3
    assert mgr.stats.cpu_hits == 0
    assert mgr.stats.hit_rate == pytest.approx(20 / 58)
    assert mgr.num_free_blocks == 2
    assert mgr.usage == pytest.approx(0.8)
