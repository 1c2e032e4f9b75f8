"""The CPU tier of the prefix cache (DESIGN.md §3.1), worked by hand.

GPU: num_blocks=4 (blocks 1..3 usable), block_size 2; CPU: 2 slots. The fake copy function moves
"contents" between two dicts the way the engine would move KV data; each GPU block's content is
written by the test when a request computes into it (the reference digest of the prefix it holds),
so a block copied back from the CPU can be checked to hold the data of its hash.
"""

from __future__ import annotations

from collections import Counter

import pytest

from kvroute.events import CPU, GPU, BlockRemoved, BlockStored
from replica.kv import KVCacheManager, SimpleKVRequest
from tests.replica.kv._reference import event_int as ev
from tests.replica.kv._reference import ref_chain as reference_chain

B = 2


def ref_chain(tokens):
    return reference_chain(tokens, B)


A_TOKENS = [1, 2, 3, 4, 5]
B_TOKENS = [11, 12, 13]
C_TOKENS = [21, 22, 23, 24, 25]
a0, a1 = map(ev, ref_chain(A_TOKENS))
(b0,) = map(ev, ref_chain(B_TOKENS))
c0, c1 = map(ev, ref_chain(C_TOKENS))


class FakeCopy:
    """Records copy calls and moves block contents between a GPU and a CPU dict."""

    def __init__(self):
        self.calls: list[tuple[str, int, int]] = []
        self.gpu: dict[int, object] = {}
        self.cpu: dict[int, object] = {}

    def __call__(self, direction, src, dst):
        self.calls.append((direction, src, dst))
        if direction == "to_cpu":
            self.cpu[dst] = self.gpu[src]
        else:
            assert direction == "to_gpu"
            self.gpu[dst] = self.cpu[src]


def run(mgr, copy, req):
    """Admit ``req`` and compute its whole prompt; returns (computed blocks, events of the step)."""
    computed = mgr.get_computed_blocks(req)
    n = computed.num_computed_tokens
    assert mgr.allocate_slots(req, req.num_tokens - n, n, computed) is not None
    table = mgr.get_block_ids(req.request_id)
    chain = ref_chain(req.all_token_ids)
    for i in range(n // B):  # every hit, GPU or CPU, must hold the data of its hash now
        assert copy.gpu[table[i]] == chain[i], f"block {table[i]} (position {i}) holds the wrong data"
    for i in range(n // B, len(table)):  # the engine computes the rest
        copy.gpu[table[i]] = chain[i] if i < len(chain) else ("partial", req.request_id)
    req.num_computed_tokens = req.num_tokens
    return computed, mgr.take_events()


def test_cpu_tier_offloads_on_eviction_restores_on_hit_and_evicts_lru():
    copy = FakeCopy()
    mgr = KVCacheManager(num_blocks=4, block_size=B, cpu_num_blocks=2, copy_fn=copy)

    # 1. A = [1..5]: blocks [1,2,3], a0 in block 1, a1 in block 2.
    a = SimpleKVRequest("a", list(A_TOKENS))
    _, events = run(mgr, copy, a)
    assert mgr.get_block_ids("a") == [1, 2, 3]
    assert events == [BlockStored((a0, a1), None, (1, 2, 3, 4), B)]
    mgr.free(a)  # lru: uncached block 3 to the head, then 2, 1 to the tail
    assert [blk.block_id for blk in mgr.block_pool.free_block_queue.get_all_free_blocks()] == [3, 2, 1]

    # 2. B = [11,12,13] takes blocks 3 and 2: evicting a1 offloads it to CPU slot 0.
    b = SimpleKVRequest("b", list(B_TOKENS))
    _, events = run(mgr, copy, b)
    assert mgr.get_block_ids("b") == [3, 2]
    assert events == [
        BlockRemoved((a1,), GPU),
        BlockStored((a1,), None, (), 0, None, CPU, None),
        BlockStored((b0,), None, (11, 12), B),
    ]
    assert copy.calls == [("to_cpu", 2, 0)]
    assert copy.cpu[0] == ref_chain(A_TOKENS)[1]
    assert mgr.cached_event_hashes() == {GPU: [a0, b0], CPU: [a1]}
    mgr.free(b)

    # B's blocks: 3 holds b0, 2 holds token 13 (uncached) -> free queue [2, 1, 3].
    # 3. A again: a0 hits on the GPU (block 1), a1 misses there but hits on the CPU; both count as
    #    hits. The new blocks are 2 (a1 is copied back into it and announced on the GPU again) and
    #    3, whose eviction offloads b0 to CPU slot 1 first.
    a2 = SimpleKVRequest("a2", list(A_TOKENS))
    computed, events = run(mgr, copy, a2)
    assert [blk.block_id for blk in computed.blocks] == [1]
    assert [ev(h) for h in computed.cpu_block_hashes] == [a1]
    assert mgr.get_block_ids("a2") == [1, 2, 3]
    assert copy.calls[1:] == [("to_cpu", 3, 1), ("to_gpu", 0, 2)]
    assert events == [
        BlockRemoved((b0,), GPU),
        BlockStored((b0,), None, (), 0, None, CPU, None),
        BlockStored((a1,), a0, (3, 4), B),
    ]
    assert (mgr.stats.queries, mgr.stats.hits, mgr.stats.cpu_hits) == (13, 4, 2)
    assert Counter(mgr.cached_event_hashes()[GPU]) == Counter([a0, a1])
    assert Counter(mgr.cached_event_hashes()[CPU]) == Counter([a1, b0])
    mgr.free(a2)

    # 4. C = [21..25] takes blocks 3, 2, 1. a1 (block 2) is already on the CPU: no copy, no CPU
    #    event. a0 (block 1) needs a slot: the CPU tier is full and b0 is its least recently used
    #    entry (the restore of a1 touched a1), so b0 is evicted from the CPU.
    c = SimpleKVRequest("c", list(C_TOKENS))
    _, events = run(mgr, copy, c)
    assert mgr.get_block_ids("c") == [3, 2, 1]
    assert events == [
        BlockRemoved((a1,), GPU),
        BlockRemoved((a0,), GPU),
        BlockRemoved((b0,), CPU),
        BlockStored((a0,), None, (), 0, None, CPU, None),
        BlockStored((c0, c1), None, (21, 22, 23, 24), B),
    ]
    assert copy.calls[3:] == [("to_cpu", 1, 1)]
    assert copy.cpu == {0: ref_chain(A_TOKENS)[1], 1: ref_chain(A_TOKENS)[0]}
    assert mgr.cached_event_hashes() == {GPU: [c0, c1], CPU: [a1, a0]}
    mgr.free(c)

    # 5. A once more: both blocks hit on the CPU only. They are pinned while GPU blocks are taken,
    #    so evicting c1 (block 2) and c0 (block 3) finds no unpinned CPU slot: those two are
    #    dropped, not offloaded.
    a3 = SimpleKVRequest("a3", list(A_TOKENS))
    computed, events = run(mgr, copy, a3)
    assert computed.blocks == []
    assert [ev(h) for h in computed.cpu_block_hashes] == [a0, a1]
    assert mgr.get_block_ids("a3") == [1, 2, 3]
    assert copy.calls[4:] == [("to_gpu", 1, 1), ("to_gpu", 0, 2)]
    assert events == [
        BlockRemoved((c1,), GPU),
        BlockRemoved((c0,), GPU),
        BlockStored((a0, a1), None, (1, 2, 3, 4), B),
    ]
    assert (mgr.stats.queries, mgr.stats.hits, mgr.stats.cpu_hits) == (23, 8, 6)
    assert Counter(mgr.cached_event_hashes()[GPU]) == Counter([a0, a1])
    assert Counter(mgr.cached_event_hashes()[CPU]) == Counter([a0, a1])
    mgr.free(a3)

    # reset clears both media at once
    assert mgr.reset_prefix_cache() is True
    assert mgr.cached_event_hashes() == {GPU: [], CPU: []}


def test_cpu_tier_requires_a_copy_fn():
    with pytest.raises(ValueError, match="copy_fn"):
        KVCacheManager(num_blocks=4, block_size=B, cpu_num_blocks=2)


def test_duplicate_gpu_copies_are_offloaded_only_when_the_last_one_goes():
    copy = FakeCopy()
    mgr = KVCacheManager(num_blocks=6, block_size=B, cpu_num_blocks=2, copy_fn=copy)
    x, y = SimpleKVRequest("x", [1, 2, 3, 4]), SimpleKVRequest("y", [1, 2, 3, 4])
    run(mgr, copy, x)  # blocks [1, 2]
    run(mgr, copy, y)  # hits block 1; caches a1 again in block 3
    assert Counter(mgr.cached_event_hashes()[GPU]) == Counter([a0, a1, a1])
    mgr.free(x)
    mgr.free(y)
    # free queue (lru): [4, 5, 2, 3, 1]; 3 new blocks take 4, 5 and 2 (one copy of a1)
    z = SimpleKVRequest("z", [7, 8, 9, 10, 11])
    _, events = run(mgr, copy, z)
    assert mgr.get_block_ids("z") == [4, 5, 2]
    assert events[0] == BlockRemoved((a1,), GPU)
    assert not any(e.medium == CPU for e in events)  # block 3 still holds a1: nothing offloaded
    assert copy.calls == []
