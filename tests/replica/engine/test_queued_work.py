"""The queued prefill the replica reports (``Scheduler.queued_prefill_tokens``, the heartbeat's
``queued_prefill_tokens``): tokens still to compute, so a waiting prompt whose prefix is cached,
or will be by a request queued ahead of it, counts only the rest. Hand-worked with 4-token blocks."""

from __future__ import annotations

from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replica.engine.params import SamplingParams
from replica.engine.request import Request
from replica.engine.scheduler import Scheduler
from replica.kv import KVCacheManager

B = 4


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), max_tokens=4)


def test_a_waiting_prompt_counts_the_tokens_its_prefix_hit_leaves():
    sched = Scheduler(KVCacheManager(num_blocks=33, block_size=B), max_num_batched_tokens=64)
    a = _req("a", list(range(100, 112)))  # 12 tokens, 3 full blocks, none cached
    sched.add_request(a)
    assert sched.queued_prefill_tokens == 12
    # b shares a's first 2 blocks; a, queued ahead, will have computed them: b counts 12 - 8
    b = _req("b", list(range(100, 108)) + [7, 7, 7, 7])
    sched.add_request(b)
    assert b.num_expected_hit_tokens == 8 and sched.queued_prefill_tokens == 12 + 4
    # c repeats a whole: at most (12 - 1) // 4 = 2 blocks are looked up (the last token is recomputed)
    c = _req("c", list(range(100, 112)))
    sched.add_request(c)
    assert c.num_expected_hit_tokens == 8 and sched.queued_prefill_tokens == 12 + 4 + 4
    # d shares nothing
    sched.add_request(_req("d", [1, 2, 3, 4, 5, 6]))
    assert sched.queued_prefill_tokens == 26

    out = sched.schedule()  # all four admitted in one step: the hits are the real ones
    assert [s.request.request_id for s in out.scheduled] == ["a", "b", "c", "d"]
    assert [s.request.num_cached_tokens for s in out.scheduled] == [0, 8, 8, 0]
    assert sched.queued_prefill_tokens == 0  # every prompt computed this step (its last token samples)


def test_the_pending_blocks_leave_with_the_request_that_would_compute_them():
    sched = Scheduler(KVCacheManager(num_blocks=33, block_size=B), max_num_batched_tokens=64)
    a = _req("a", list(range(100, 112)))
    sched.add_request(a)
    sched.finish_request(a)  # aborted while waiting: nothing of it will be computed
    b = _req("b", list(range(100, 108)) + [7, 7, 7, 7])
    sched.add_request(b)
    assert b.num_expected_hit_tokens == 0 and sched.queued_prefill_tokens == 12
    sched.schedule()  # b computed and cached (its 3 full blocks)
    sched.finish_request(b)
    # e arrives after b: its 2 leading blocks are in the cache now
    e = _req("e", list(range(100, 108)) + [9, 9, 9])
    sched.add_request(e)
    assert e.num_expected_hit_tokens == 8 and sched.queued_prefill_tokens == 3
    assert not sched._pending_blocks.keys() - set(e.block_hashes)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(["add", "add", "step", "step", "step", "finish"]), st.integers(0, 5),
                          st.integers(1, 14)), max_size=80))
def test_pending_blocks_are_exactly_those_of_the_prompts_not_yet_admitted(ops):
    """Whatever the order of arrivals, steps (with preemption: a small pool) and finishes, the
    pending blocks are the multiset of the full-block hashes of the waiting prompts never admitted,
    and the queued work never counts a prompt's tokens twice or below zero."""
    sched = Scheduler(KVCacheManager(num_blocks=7, block_size=B), max_num_batched_tokens=12, max_num_seqs=4)
    live: list[Request] = []
    for n, (op, which, length) in enumerate(ops):
        if op == "add":
            # prompts drawn from a few shared prefixes, so pending blocks overlap
            req = _req(f"r{n}", [100 + which % 2] * 4 + list(range(200, 200 + length)))
            sched.add_request(req)
            live.append(req)
        elif op == "step":
            out = sched.schedule()
            for s in out.scheduled:  # what the engine does after the step: a sampled token
                if s.samples:
                    s.request.append_output_token(7)
        elif live:
            req = live.pop(which % len(live))
            sched.finish_request(req)
        expected: Counter[bytes] = Counter()
        for r in sched.waiting:
            if r.num_cached_tokens < 0:
                expected.update(r.block_hashes)
        assert +sched._pending_blocks == expected
        assert 0 <= sched.queued_prefill_tokens <= sum(r.num_tokens for r in [*sched.waiting, *sched.running])
