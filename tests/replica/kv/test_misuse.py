"""Misuse of the KV cache raises KVCacheError naming the problem, and leaks nothing."""

from __future__ import annotations

import pytest

from kvroute.events import AllBlocksCleared
from replica.kv import (
    BlockPool,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    KVCacheError,
    KVCacheManager,
    SimpleKVRequest,
)

B = 4


def state(mgr):
    """Everything a failed call must leave unchanged."""
    pool = mgr.block_pool
    return (
        mgr.num_free_blocks,
        mgr.usage,
        [b.block_id for b in pool.free_block_queue.get_all_free_blocks()],
        [b.ref_cnt for b in pool.blocks],
        {b.block_id: b.block_hash for b in pool.blocks},
        {rid: [b.block_id for b in blocks] for rid, blocks in mgr.req_to_blocks.items()},
        dict(mgr.num_cached_block),
        (mgr.stats.queries, mgr.stats.hits, mgr.stats.cpu_hits, mgr.stats.requests),
    )


@pytest.fixture
def mgr():
    """A manager with one running request holding 3 blocks (10 tokens) and one freed cached prefix."""
    m = KVCacheManager(num_blocks=9, block_size=B, vocab_size=1000)
    done = SimpleKVRequest("done", list(range(1, 9)))
    assert m.allocate_slots(done, 8) is not None
    m.free(done)
    running = SimpleKVRequest("running", list(range(20, 30)))
    assert m.allocate_slots(running, 10) is not None
    running.num_computed_tokens = 10
    m.take_events()
    return m


def running_req(mgr):
    req = SimpleKVRequest("running", list(range(20, 30)), num_computed_tokens=10)
    assert mgr.get_block_ids("running") == [3, 4, 5]
    return req


def test_double_free_of_a_request_names_it(mgr):
    req = running_req(mgr)
    mgr.free(req)
    before = state(mgr)
    with pytest.raises(KVCacheError, match=r"unknown request 'running'.*already freed"):
        mgr.free(req)
    assert state(mgr) == before
    assert mgr.usage == 0.0 and mgr.num_free_blocks == 8


def test_block_pool_free_of_a_ref_cnt_0_block_is_a_double_free():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(2)
    pool.free_blocks(blocks)
    with pytest.raises(KVCacheError, match="double free of block 1"):
        pool.free_blocks(blocks[:1])
    assert pool.get_num_free_blocks() == 4
    assert [b.ref_cnt for b in pool.blocks] == [0, 0, 0, 0, 0]


def test_block_pool_double_free_leaves_other_blocks_untouched():
    pool = BlockPool(5)
    held = pool.get_new_blocks(2)
    freed = pool.get_new_blocks(1)
    pool.free_blocks(freed)
    with pytest.raises(KVCacheError, match="double free"):
        pool.free_blocks([held[0], freed[0]])  # held[0] is fine, freed[0] is not: nothing changes
    assert [b.ref_cnt for b in held] == [1, 1]
    assert pool.get_num_free_blocks() == 2


def test_block_pool_freeing_one_block_twice_in_a_call_is_a_double_free():
    pool = BlockPool(5)
    (block,) = pool.get_new_blocks(1)
    with pytest.raises(KVCacheError, match="double free"):
        pool.free_blocks([block, block])
    assert block.ref_cnt == 1
    assert pool.get_num_free_blocks() == 3
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and pool.get_num_free_blocks() == 4


def test_get_new_blocks_beyond_free_raises_and_changes_nothing():
    pool = BlockPool(4)
    with pytest.raises(KVCacheError, match="asked for 4 blocks, 3 free"):
        pool.get_new_blocks(4)
    assert pool.get_num_free_blocks() == 3


def test_free_queue_rejects_a_queued_block_and_stays_consistent():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks[:3])
    with pytest.raises(ValueError, match="block 1 is already in the free queue"):
        q.append_n([blocks[3], blocks[1], blocks[4]])
    ids = [b.block_id for b in q.get_all_free_blocks()]
    assert ids == [0, 1, 2, 3] and q.num_free_blocks == 4  # block 3 linked, the rest untouched
    with pytest.raises(ValueError, match="already in the free queue"):
        q.prepend_n([blocks[4], blocks[4]])
    assert [b.block_id for b in q.get_all_free_blocks()] == [4, 0, 1, 2, 3]
    with pytest.raises(ValueError, match="asked for 6 blocks, 5 free"):
        q.popleft_n(6)
    assert [b.block_id for b in q.popleft_n(2)] == [4, 0]
    assert [b.block_id for b in q.get_all_free_blocks()] == [1, 2, 3] and q.num_free_blocks == 3
    with pytest.raises(ValueError, match="not in the free queue"):
        q.remove(blocks[0])


def test_unknown_request_in_get_block_ids(mgr):
    with pytest.raises(KVCacheError, match="unknown request 'nope'"):
        mgr.get_block_ids("nope")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_new_tokens": 0}, "num_new_tokens must be > 0, got 0"),
        ({"num_new_tokens": -3}, "num_new_tokens must be > 0, got -3"),
        (
            {"num_new_tokens": 1, "num_new_computed_tokens": -4},
            "num_new_computed_tokens must be >= 0, got -4",
        ),
        ({"num_new_tokens": 1, "num_lookahead_tokens": -1}, "num_lookahead_tokens must be >= 0, got -1"),
    ],
    ids=["zero-new", "negative-new", "negative-computed", "negative-lookahead"],
)
@pytest.mark.parametrize("which", ["new", "running"])
def test_bad_counts_raise_and_leak_nothing(mgr, kwargs, match, which):
    req = running_req(mgr) if which == "running" else SimpleKVRequest("new", list(range(1, 13)))
    if which == "running":
        req.append_output_token_ids(7)
    before = state(mgr)
    with pytest.raises(KVCacheError, match=match):
        mgr.allocate_slots(req, **kwargs)
    assert state(mgr) == before
    assert mgr.take_events() == []


@pytest.mark.parametrize("bad", [1000, 123456, -5])
def test_token_outside_vocabulary_is_rejected_naming_the_id(mgr, bad):
    req = SimpleKVRequest("new", [1, 2, 3, 4, 5, bad, 7])
    before = state(mgr)
    with pytest.raises(KVCacheError, match=rf"token id {bad}\b"):
        mgr.get_computed_blocks(req)
    with pytest.raises(KVCacheError, match=rf"token id {bad}\b"):
        mgr.allocate_slots(req, 7)
    assert state(mgr) == before
    assert mgr.take_events() == []


def test_another_requests_lookup_does_not_vouch_for_these_ids(mgr):
    """allocate_slots skips ids that get_computed_blocks already checked, but only for that request."""
    good = SimpleKVRequest("good", [301, 302, 303, 304, 305, 306, 307])
    computed = mgr.get_computed_blocks(good)
    assert computed.num_computed_tokens == 0
    bad = SimpleKVRequest("bad", [301, 302, 303, 304, 305, 1000, 307])
    before = state(mgr)
    with pytest.raises(KVCacheError, match="token id 1000"):
        mgr.allocate_slots(bad, 7, 0, computed)
    assert state(mgr) == before


@pytest.mark.parametrize("bad", [2.5, "7", None])
def test_non_integer_token_ids_are_rejected(mgr, bad):
    req = SimpleKVRequest("odd", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, bad])
    with pytest.raises(KVCacheError, match="must be integers"):
        mgr.get_computed_blocks(req)


def test_decoded_token_outside_vocabulary_is_rejected(mgr):
    req = running_req(mgr)
    req.append_output_token_ids(1000)
    before = state(mgr)
    with pytest.raises(KVCacheError, match="token id 1000"):
        mgr.allocate_slots(req, 1)
    assert state(mgr) == before


def test_vocabulary_is_not_checked_when_unconfigured():
    m = KVCacheManager(num_blocks=4, block_size=B)
    assert m.allocate_slots(SimpleKVRequest("r", [10**9, 1, 2]), 3) is not None


@pytest.mark.parametrize("which", ["new", "running"])
def test_allocate_beyond_the_request_tokens_raises(mgr, which):
    req = running_req(mgr) if which == "running" else SimpleKVRequest("new", list(range(1, 6)))
    before = state(mgr)
    with pytest.raises(KVCacheError, match="asked to compute up to"):
        mgr.allocate_slots(req, 1 if which == "running" else 6)
    assert state(mgr) == before


def test_prefix_hits_for_a_running_request_raise(mgr):
    req = running_req(mgr)
    computed = mgr.get_computed_blocks(SimpleKVRequest("probe", list(range(1, 10))))
    assert computed.num_computed_tokens == 8
    req.append_output_token_ids(3)
    before = state(mgr)
    with pytest.raises(KVCacheError, match="prefix hits apply at admission only"):
        mgr.allocate_slots(req, 1, 8, computed)
    assert state(mgr) == before


def test_get_computed_blocks_of_a_running_request_raises(mgr):
    with pytest.raises(KVCacheError, match="already holds blocks"):
        mgr.get_computed_blocks(running_req(mgr))


def test_mismatched_num_new_computed_tokens_raises(mgr):
    req = SimpleKVRequest("new", list(range(1, 10)))
    computed = mgr.get_computed_blocks(req)
    before = state(mgr)
    with pytest.raises(KVCacheError, match="num_new_computed_tokens=4 but the computed blocks cover 8"):
        mgr.allocate_slots(req, 5, 4, computed)
    assert state(mgr) == before


def test_allocate_slots_returns_none_and_changes_nothing_when_blocks_are_short(mgr):
    # 8 usable blocks: "running" holds 3; 5 are free, 2 of them hold the cached prefix 1..8.
    assert mgr.num_free_blocks == 5
    req = SimpleKVRequest("big", list(range(1, 9)) + list(range(40, 60)))  # 28 tokens = 7 blocks
    computed = mgr.get_computed_blocks(req)
    assert [b.block_id for b in computed.blocks] == [1, 2]  # both free, cached: they count as used
    before = state(mgr)
    assert mgr.allocate_slots(req, 20, 8, computed) is None
    assert state(mgr) == before
    assert mgr.take_events() == []
    assert "big" not in mgr.req_to_blocks
    # one block less fits: 20 tokens = 5 blocks, the 2 hits plus 3 new = the 3 other free blocks
    req2 = SimpleKVRequest("fits", list(range(1, 9)) + list(range(40, 52)))  # 20 tokens = 5 blocks
    computed = mgr.get_computed_blocks(req2)
    assert mgr.allocate_slots(req2, 12, 8, computed) is not None
    assert mgr.num_free_blocks == 0


def test_allocate_slots_returns_none_for_a_running_request_without_side_effects():
    m = KVCacheManager(num_blocks=3, block_size=B)
    req = SimpleKVRequest("r", list(range(1, 9)))
    assert m.allocate_slots(req, 8) is not None
    req.num_computed_tokens = 8
    m.take_events()
    req.append_output_token_ids(9)
    before = state(m)
    assert m.allocate_slots(req, 1) is None
    assert state(m) == before
    assert m.take_events() == []


def test_reset_prefix_cache_refused_while_blocks_are_held(mgr):
    before = state(mgr)
    assert mgr.reset_prefix_cache() is False
    assert state(mgr) == before
    assert mgr.take_events() == []


def test_required_reset_prefix_cache_raises_naming_the_blocks_in_use(mgr):
    before = state(mgr)
    with pytest.raises(KVCacheError, match=r"reset_prefix_cache: refused, 3 blocks are in use"):
        mgr.reset_prefix_cache(must_succeed=True)
    assert state(mgr) == before
    assert mgr.take_events() == []


def test_reset_prefix_cache_clears_everything_when_nothing_is_held(mgr):
    mgr.free(running_req(mgr))
    mgr.take_events()
    assert mgr.reset_prefix_cache() is True
    assert mgr.take_events() == [AllBlocksCleared(None)]
    assert all(b.block_hash is None and b.event_hash is None for b in mgr.block_pool.blocks)
    assert mgr.cached_event_hashes() == {"GPU": [], "CPU": []}
    assert mgr.num_free_blocks == 8
    assert mgr.get_computed_blocks(SimpleKVRequest("again", list(range(1, 10)))).blocks == []


def test_allocate_past_max_model_len_is_refused_and_changes_nothing():
    from replica.kv import KVCacheError, KVCacheManager, SimpleKVRequest

    kv = KVCacheManager(num_blocks=16, block_size=4, max_model_len=10)
    req = SimpleKVRequest("long", list(range(12)))
    free_before = kv.num_free_blocks
    with pytest.raises(KVCacheError, match="max_model_len=10"):
        kv.allocate_slots(req, 12)
    assert kv.num_free_blocks == free_before
    assert kv.req_to_blocks == {}
