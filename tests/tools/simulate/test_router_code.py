"""The simulator decides with the router's own code: swapping a scorer
of the kvroute policy changes the picks, and the peer policies run through the same Router."""

from __future__ import annotations

import random

import pytest

from kvroute.hashing import BlockHasher
from kvroute_tools.simulate.cluster import SimConfig, simulate
from kvroute_tools.simulate.workload import prompt_of
from kvroute_tools.trace import TRACE_BLOCK_TOKENS, TraceRequest
from router.policies.baselines import RoundRobinPolicy
from router.policies.kvroute import KVRoutePolicy
from router.policies.registry import PEER_POLICY_NAMES
from router.scoring import DEFAULT_SCORERS


def _conversations() -> list[TraceRequest]:
    # Three conversations of three turns, each turn extending the previous prompt by a block,
    # sent turn by turn a second apart (4 tokens per trace block, 4-token KV blocks).
    out = []
    for turn in range(3):
        for conv in range(3):
            ids = tuple(100 * conv + k for k in range(2 + turn))
            out.append(TraceRequest(1000.0 * len(out), len(ids) * TRACE_BLOCK_TOKENS, 2, ids))
    return out


def _cfg() -> SimConfig:
    return SimConfig(replicas=4, num_blocks=256, block_size=4, tokens_per_block=4)


def test_swapping_a_scorer_changes_the_picks():
    trace = _conversations()
    default = simulate(trace, _cfg(), "kvroute")
    # Same policy class, one scorer replaced: a cost that grows with the cached prefix.
    scorers = dict(DEFAULT_SCORERS, prefill_work=lambda c, req, w: float(c.match.gpu))
    anti = simulate(trace, _cfg(), "kvroute", policy=KVRoutePolicy(scorers=scorers, rng=random.Random(0)))
    picks = [r.replica for r in default.requests]
    # Default: each conversation stays where its prefix is cached, so turns 2 and 3 hit their
    # previous prompt (2, then 3 blocks of 4 tokens: the lookable ones).
    assert [picks[i] for i in (0, 3, 6)].count(picks[0]) == 3
    assert sum(r.cached_tokens for r in default.requests) == 3 * (8 + 12)
    assert [r.replica for r in anti.requests] != picks
    assert sum(r.cached_tokens for r in anti.requests) < sum(r.cached_tokens for r in default.requests)


@pytest.mark.parametrize("name", PEER_POLICY_NAMES + ("round_robin", "least_loaded", "random"))
def test_every_policy_routes_the_whole_trace(name):
    run = simulate(_conversations(), _cfg(), name)
    assert sum(run.routed) == 9
    assert all(r.finish_s >= r.first_token_s > r.arrival_s for r in run.requests)


class _Recording(RoundRobinPolicy):
    """Round robin that records what the simulator tells it through the declared hooks."""

    observes_prompt = True

    def __init__(self):
        super().__init__()
        self.prompts: list[list[int]] = []
        self.capacity = None

    def observe_prompt(self, block_hashes):
        self.prompts.append(list(block_hashes))

    def set_block_capacity(self, blocks):
        self.capacity = blocks


def test_the_simulator_drives_the_declared_hooks():
    trace, cfg = _conversations(), _cfg()
    policy = _Recording()
    simulate(trace, cfg, "recording", policy=policy)
    assert policy.capacity == 256 - 1  # block 0 is the null block
    hasher = BlockHasher(block_size=4)
    expected = [hasher.event_ints(prompt_of(req, cfg.tokens_per_block)) for req in trace]
    assert policy.prompts == [list(e) for e in expected]
    assert [len(p) for p in policy.prompts] == [2, 2, 2, 3, 3, 3, 4, 4, 4]  # whole 4-token blocks


def test_a_policy_without_the_hooks_is_left_alone():
    policy = RoundRobinPolicy()
    simulate(_conversations(), _cfg(), "round_robin", policy=policy)
    assert not policy.observes_prompt and policy.index_from_kv_events and policy.speculative_ttl is None
