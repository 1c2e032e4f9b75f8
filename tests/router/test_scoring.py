"""router/scoring.py's decision path on each build: a decision's CandidateTable costed by the
compiled pass (router/_scoring.c) and by the Python loop over its Candidate objects give the same
pick, the same draws from the tie generator and the same cost for every candidate, bit for bit,
at any number of replicas; and the table's candidates are the ones the registry, the index and the
load say."""

from __future__ import annotations

import contextlib
import random
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import router.scoring
from kvroute.hashing import BlockHasher
from router.core import Router
from router.index import BlockIndex, Match
from router.load import LoadTracker
from router.policies.kvroute import KVRoutePolicy
from router.registry import ReplicaRegistry
from router.scoring import Candidate, CandidateTable, RequestShape, ScoringWeights
from tests.router.test_decisions import heartbeat

B = 4
PATHS = ["python", "c"] if router.scoring._scoring is not None else ["python"]


def path(name: str):
    return mock.patch.object(router.scoring, "_scoring", None) if name == "python" else contextlib.nullcontext()


def cluster(seed: int, replicas: int, weights: ScoringWeights) -> tuple[Router, list[list[int]]]:
    """A router over ``replicas`` replicas with random heartbeats, cached prefixes of a few shared
    documents (GPU and CPU) and some load committed; and the documents."""
    rng = random.Random(seed)
    hasher = BlockHasher(block_size=B)
    registry = ReplicaRegistry(hasher.identity, "redis")
    for i in range(replicas):
        load = {"running": rng.randrange(8), "waiting": rng.randrange(4), "usage": rng.choice([0.0, rng.random()]),
                "queued_prefill_tokens": rng.choice([0, rng.randrange(5000)]),
                "prefill_tokens_per_s": rng.choice([0.0, 0.0, rng.uniform(1e3, 1e5)]),
                "decode_seconds_per_running": rng.choice([0.0, rng.uniform(1e-4, 1e-2)])}
        registry.update_from_heartbeat(heartbeat(f"r{i}", i, hasher, **load), now=0.0)
    docs = [[rng.randrange(10, 30000) for _ in range(B * 24)] for _ in range(4)]
    index = BlockIndex(speculative_ttl=60.0, clock=lambda: 0.0)
    for i in range(replicas):
        for d in rng.sample(range(len(docs)), 2):
            chain = hasher.event_ints(docs[d])
            cut = rng.randrange(len(chain) + 1)
            index.add(f"r{i}", chain[:cut])
            index.add(f"r{i}", chain[cut:cut + rng.randrange(4)], "CPU")
    router = Router(hasher, index, registry, LoadTracker(), KVRoutePolicy(weights, rng=random.Random(seed)))
    return router, docs


WEIGHTS = st.sampled_from([
    ScoringWeights(),  # the pool's measured rates (the defaults where none measured)
    ScoringWeights(prefill_tokens_per_s=1234.5, decode_seconds_per_running=0.0031, prefill_work_weight=2.5,
                   cpu_match_weight=0.3, kv_footprint_weight=1.7, kv_usage_weight=0.07, in_flight_weight=0.011),
    ScoringWeights(prefill_work_weight=0.0, kv_footprint_weight=0.0),  # many exact ties
])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 2**32), st.sampled_from([1, 3, 70, 300]), WEIGHTS)
def test_the_compiled_and_python_costs_decide_alike(seed, replicas, weights):
    outcomes = []
    for name in PATHS:
        with path(name):
            router, docs = cluster(seed, replicas, weights)
            rng = random.Random(seed)
            seen = []
            for k in range(12):
                tokens = rng.choice(docs)[: rng.randrange(1, B * 24)] + [rng.randrange(10, 30000)]
                exclude = {f"r{rng.randrange(replicas)}"} if k % 3 == 0 else set()
                d = router.decide(tokens, exclude=exclude)
                seen.append((d.picked.replica_id if d.picked else None, d.predicted_cached_tokens,
                             [(s.candidate.replica_id, s.cost, s.candidate.match, s.candidate.queued_prefill_tokens)
                              for s in d.scored]))
                req = RequestShape(len(tokens), B)  # each cost is the scorers' sum
                assert all(s.cost == router.policy.score(s.candidate, req).cost for s in d.scored)
                if d.picked is not None and k % 2 == 0:
                    router.commit(d)  # load for the next decisions
            outcomes.append((seen, router.policy.rng.getstate()))
    assert outcomes[0] == outcomes[-1]


@pytest.mark.parametrize("name", PATHS)
def test_a_candidate_is_made_from_its_record_its_match_and_the_routers_load(name):
    with path(name):
        router, docs = cluster(1, 5, ScoringWeights())
        infos = router.registry.routable()
        table = CandidateTable(infos, {"r2": Match(gpu=3, cpu=1)}, {"r2": 4}, {"r2": 10**6, "r3": 1})
    c = table[2]
    assert (c.replica_id, c.match, c.in_flight, c.queued_prefill_tokens) == ("r2", Match(gpu=3, cpu=1), 4, 10**6)
    assert table[2] is c and table[-3] is c and [x.replica_id for x in table[1:3]] == ["r1", "r2"]
    assert table[3].queued_prefill_tokens == max(infos[3].queued_prefill_tokens, 1)  # the larger of the two
    assert table[0].match == Match() and table.info_of(table[4]) is infos[4]
    assert table.info_of(Candidate("r1")) is infos[1]
    measured = sorted(v for v in (i.decode_seconds_per_running for i in infos) if v > 0)
    assert c.decode_seconds_per_running == (measured[len(measured) // 2] if len(measured) % 2
                                            else (measured[len(measured) // 2 - 1] + measured[len(measured) // 2]) / 2
                                            if measured else 0.0)
    policy = KVRoutePolicy(ScoringWeights())
    req = RequestShape(40, B)
    assert policy.costs(table, req) == [policy.score(x, req).cost for x in table]


@pytest.mark.skipif("c" not in PATHS, reason="router._scoring not built")
@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.one_of(st.floats(allow_nan=True), st.sampled_from([0.0, 1.5, 2.5]), st.integers(-3, 3)),
                          st.one_of(st.floats(-1, 1), st.sampled_from([0.0, 0.25]))), max_size=40))
def test_the_compiled_pool_rates_are_the_medians_of_the_positive_ones(rates):
    from types import SimpleNamespace

    from router.scoring import pool_rate

    infos = [SimpleNamespace(prefill_tokens_per_s=p, decode_seconds_per_running=d) for p, d in rates]
    got = router.scoring._scoring.pool_rates(infos)
    assert got == (pool_rate(p for p, _ in rates), pool_rate(d for _, d in rates))

