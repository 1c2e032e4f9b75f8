"""Several routers in the simulator (kvroute_tools/simulate/cluster.py, ``routers`` /
``load_sync_s``): each router sees the others' in-flight load and speculative entries only as of
its last sync; synced before every decision, N routers decide exactly as one."""

from __future__ import annotations

import pytest

from kvroute_tools.simulate.cluster import SimConfig, simulate
from kvroute_tools.trace import TRACE_BLOCK_TOKENS, TraceRequest, load_mooncake
from router.weights import ScoringWeights

# The cost reduced to the TTFT terms at a fixed rate: (queued prefill + uncached) / 1000 tokens/s
# + running x 1 ms (no prefill-work, backlog or KV-footprint term), so the sums below are all of it.
TTFT_ONLY = ScoringWeights(prefill_tokens_per_s=1000.0, decode_seconds_per_running=0.001, prefill_work_weight=0.0,
                           backlog_work_weight=0.0, kv_footprint_weight=0.0)


def _request(t_ms: float, ids: tuple[int, ...]) -> TraceRequest:
    return TraceRequest(t_ms, len(ids) * TRACE_BLOCK_TOKENS, 2, ids)


def _burst_after_a_warm_prefix() -> list[TraceRequest]:
    # 4 tokens per hash id, 4-token KV blocks. Request 0 (router 0) caches blocks 1, 2 on one
    # replica, W, and is long done by 100.3 s; then a burst of two 5-block prompts sharing those
    # two blocks, 1 ms apart: request 1 through router 1, request 2 through router 0.
    return [_request(0.0, (1, 2)), _request(100_300.0, (1, 2, 3, 4, 5)), _request(100_301.0, (1, 2, 6, 7, 8))]


def _cfg(**kw) -> SimConfig:
    return SimConfig(replicas=2, num_blocks=64, block_size=4, tokens_per_block=4, weights=TTFT_ONLY, **kw)


def test_a_sync_interval_longer_than_the_burst_sends_both_routers_to_the_same_warm_replica():
    """Both burst requests are 20 tokens, 8 of them (blocks 1, 2) cached on W. Request 1: W costs
    (0 + 12) / 1000 = 12 ms, the other replica (0 + 20) / 1000 = 20 ms: W. Request 2, 1 ms later:

    - one router, or two synced before every decision: request 1's 12 uncached tokens are queued
      on W, so W costs (12 + 12) / 1000 = 24 ms against the other's 20 ms: the other replica.
    - two routers syncing every 10 s (router 0 last synced at 95 s, router 1 at 100 s, both before
      the burst): router 0 does not know of request 1 (its load nor its speculative entries), W
      costs 12 ms against 20 ms again: both requests on W, the second waiting behind the first.

    Replica heartbeats come every second, so none lands inside the burst's millisecond.
    """
    trace = _burst_after_a_warm_prefix()
    one = simulate(trace, _cfg(routers=1), "kvroute")
    warm = one.requests[0].replica
    other = next(r for r in _cfg().replica_ids() if r != warm)
    assert [r.replica for r in one.requests] == [warm, warm, other]
    synced = simulate(trace, _cfg(routers=2, load_sync_s=0.0), "kvroute")
    assert [r.replica for r in synced.requests] == [warm, warm, other]
    late = simulate(trace, _cfg(routers=2, load_sync_s=10.0), "kvroute")
    assert late.requests[0].replica == warm  # the same tie-break draw: the routers share the generator
    assert [r.replica for r in late.requests] == [warm, warm, warm]
    assert [r.cached_tokens for r in late.requests] == [0, 8, 8]


@pytest.fixture(scope="module")
def first_300() -> list[TraceRequest]:
    return load_mooncake(limit=300)


@pytest.mark.parametrize("policy", ["kvroute", "least_loaded"])
def test_routers_synced_before_every_decision_decide_as_one(first_300, policy):
    # 4 replicas of 299 usable blocks, against the 7,515 distinct blocks of these requests, at the
    # trace's speed: queues, preemptions and evictions, so the picks depend on load, not only on
    # the prefixes.
    cfg = SimConfig(replicas=4, num_blocks=300)
    one = simulate(first_300, cfg, policy)
    for routers in (3,):
        many = simulate(first_300, SimConfig(**{**cfg.__dict__, "routers": routers, "load_sync_s": 0.0}), policy)
        assert [r.replica for r in many.requests] == [r.replica for r in one.requests]
        assert [r.cached_tokens for r in many.requests] == [r.cached_tokens for r in one.requests]
        assert [r.first_token_s for r in many.requests] == [r.first_token_s for r in one.requests]
    stale = simulate(first_300, SimConfig(**{**cfg.__dict__, "routers": 3, "load_sync_s": 5.0}), policy)
    assert [r.replica for r in stale.requests] != [r.replica for r in one.requests]
