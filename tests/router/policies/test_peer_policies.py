"""The peer policies' rules on hand-made candidates (router.policies)."""

from __future__ import annotations

import random

import pytest

from router.index import Match
from router.policies.chwbl import BoundedLoadHashPolicy
from router.policies.dynamo import DynamoKVPolicy
from router.policies.llmd import LlmdPolicy
from router.policies.registry import ALL_POLICY_NAMES, make_policy
from router.policies.sglang import SGLangCacheAwarePolicy
from router.scoring import Candidate, RequestShape

REQ = RequestShape(prompt_tokens=100, block_size=10)  # 10 blocks


def _c(rid: str, gpu: int = 0, in_flight: int = 0, running: int = 0, queued: int = 0, usage: float = 0.0) -> Candidate:
    return Candidate(rid, Match(gpu=gpu), queued, running, in_flight, usage)


def test_sglang_follows_a_match_above_the_threshold_else_the_smallest_tree():
    p = SGLangCacheAwarePolicy(rng=random.Random(0))
    assert p.choose([_c("a", gpu=4), _c("b", gpu=1)], REQ)[0].replica_id == "a"  # 40% > 30%
    p.tree_blocks.update({"a": 50, "b": 5})
    assert p.choose([_c("a", gpu=3), _c("b")], REQ)[0].replica_id == "b"  # 30% is not > 30%


def test_sglang_balances_when_both_thresholds_are_crossed():
    p = SGLangCacheAwarePolicy(rng=random.Random(0))
    assert p.choose([_c("a", gpu=9, in_flight=100), _c("b", in_flight=30)], REQ)[0].replica_id == "b"
    assert p.choose([_c("a", gpu=9, in_flight=90), _c("b", in_flight=30)], REQ)[0].replica_id == "a"  # 60 <= 64


def test_llmd_weighs_prefix_3_queue_2_kv_usage_2():
    p = LlmdPolicy(rng=random.Random(0))
    # a: prefix 1.0 * 3, queue 0 (4 waiting vs 0), usage 0.5 -> 3 + 0 + 1 = 4; b: 0 + 2 + 2 * 0.9 = 3.8
    pick, scored = p.choose([_c("a", gpu=10, in_flight=4, usage=0.5), _c("b", usage=0.1)], REQ)
    assert pick.replica_id == "a"
    assert [round(-s.cost, 6) for s in scored] == [4.0, 3.8]


def test_dynamo_adds_prefill_blocks_after_overlap_and_decode_blocks():
    p = DynamoKVPolicy(block_capacity=100, rng=random.Random(0))
    pick, scored = p.choose([_c("a", gpu=8, usage=0.2), _c("b", usage=0.0)], REQ)
    assert [s.cost for s in scored] == [2 + 20 + 10, 10 + 0 + 10]
    assert pick.replica_id == "b"


def test_chwbl_sticks_to_its_ring_position_until_the_load_bound():
    p = BoundedLoadHashPolicy()
    p.observe_prompt([12345, 678])
    idle = [_c(r) for r in "abcd"]
    home = p.choose(idle, REQ)[0].replica_id
    assert all(p.choose(idle, REQ)[0].replica_id == home for _ in range(3))
    # ceil(1.25 * (4 + 1) / 4) = 2: home at 2 in flight is full, the walk moves on.
    loaded = [_c(r, in_flight=2 if r == home else 0) for r in "abcd"]
    assert p.choose(loaded, REQ)[0].replica_id != home


def test_make_policy_builds_the_peer_policies():
    for name in ("sglang_cache_aware", "llmd", "dynamo", "chwbl"):
        assert make_policy(name, seed=1).name == name


def test_the_registry_builds_every_policy_by_its_name_and_refuses_others():
    assert ALL_POLICY_NAMES == ("kvroute", "round_robin", "least_loaded", "random",
                                "sglang_cache_aware", "llmd", "dynamo", "chwbl")
    for name in ALL_POLICY_NAMES:
        assert make_policy(name, seed=1).name == name
    with pytest.raises(ValueError, match="policy: unknown 'nope'; expected one of kvroute, round_robin, "
                                         "least_loaded, random, sglang_cache_aware, llmd, dynamo, chwbl"):
        make_policy("nope")
