"""Hand-worked routing decisions through the routing service every front calls (router.routing):
hashing + index + load + the kvroute cost.

Numbers: block_size 16, prefill rate 1,000 tokens/s (so 1 token = 1 ms), decode term 2 ms per
running sequence, prefill-work weight 1 (each uncached token costs 1 ms more), no kv-usage or
in-flight terms, nothing waiting. So cost(r) = queued + 2 x uncached + 2 x running, in ms.
"""

from __future__ import annotations

import functools
import itertools
import random
import time

import grpc
import pytest
import tokenizers

from kvroute.hashing import BlockHasher, BlockHashKeys
from kvroute.heartbeat import Heartbeat
from kvroute.prompt import InvalidRequestError, PromptTokenizer
from kvroute.tokenizer import Tokenizer
from kvroute.v1 import generation_pb2 as gen_pb
from router.core import Router
from router.index import BlockIndex
from router.load import LoadTracker
from router.policies.kvroute import KVRoutePolicy
from router.registry import ReplicaRegistry
from router.routing import NoReplicaError, QueuesFullError, RoutingService, classify_error
from router.scoring import ScoringWeights

B = 16
WEIGHTS = ScoringWeights(prefill_tokens_per_s=1000.0, decode_seconds_per_running=0.002, prefill_work_weight=1.0,
                         kv_footprint_weight=0.0, kv_usage_weight=0.0)  # the weights the cases below were worked by hand with


def make_router(replicas, seed=0, weights=WEIGHTS, hasher=None):
    hasher = hasher or BlockHasher(block_size=B)
    registry = ReplicaRegistry(hasher.identity, "redis")
    for i, rid in enumerate(replicas):
        registry.update_from_heartbeat(heartbeat(rid, i, hasher), now=0.0)
    router = Router(hasher, BlockIndex(speculative_ttl=60.0), registry, LoadTracker(),
                    KVRoutePolicy(weights, rng=random.Random(seed)))
    return router


def heartbeat(rid, i, hasher, **load):
    algorithm, digest, block_size = hasher.identity
    fields = {
        "replica_id": rid, "address": f"127.0.0.1:{7000 + i}", "epoch": "1", "last_seq": "0", "model": "m",
        "block_size": str(block_size), "hash_algorithm": algorithm, "hash_seed_digest": digest,
        "num_blocks": "1000", "free_blocks": "999", "running": "0", "waiting": "0", "usage": "0.0",
        "queued_prefill_tokens": "0", "ts": "0",
    }
    fields.update({k: str(v) for k, v in load.items()})
    return Heartbeat.from_redis(fields)


def prompt(seed, n):
    rng = random.Random(seed)
    return [rng.randrange(10, 30000) for _ in range(n)]


TOKENIZER = PromptTokenizer(Tokenizer(tokenizers.Tokenizer(tokenizers.models.BPE())), vocab_size=30000)


def service(router) -> RoutingService:
    """The routing service every front calls, over ``router`` (prompts here are token ids already)."""
    return RoutingService(router, TOKENIZER, policy_factory=lambda name: router.policy)


def decide(router, tokens, salt=""):
    return service(router).decide(tokens, salt or "")


def route(router, tokens, salt=""):
    """Route and commit, as a front does; the picked replica's id."""
    return service(router).route(tokens, salt or "").replica.replica_id


def test_nine_disjoint_requests_split_three_ways_counted_at_selection():
    router = make_router(["R1", "R2", "R3"], seed=7)
    picks = [route(router, prompt(i, 160)) for i in range(9)]
    assert sorted(picks.count(r) for r in ("R1", "R2", "R3")) == [3, 3, 3]
    # Same seed, same decisions.
    again = make_router(["R1", "R2", "R3"], seed=7)
    assert [route(again, prompt(i, 160)) for i in range(9)] == picks


def test_request_sharing_two_blocks_with_one_on_r2_goes_to_r2():
    router = make_router(["R1", "R2", "R3"], seed=1)
    prompts = [prompt(i, 160) for i in range(9)]
    picks = [route(router, p) for p in prompts]
    on_r2 = prompts[picks.index("R2")]
    follow_up = on_r2[: 2 * B] + prompt(99, 128)
    d = decide(router, follow_up)
    # Every replica has 3 x 160 queued tokens; R2 saves 32: 480 + 2 x 128 = 736 ms vs 480 + 2 x 160.
    assert d.picked.replica_id == "R2"
    assert d.score_of("R2").candidate.match.gpu == 2
    assert d.score_of("R2").cost == pytest.approx((480 + 2 * 128) / 1000)
    assert d.score_of("R1").cost == pytest.approx((480 + 2 * 160) / 1000)


def setup_r1_busy(r1_queued):
    """R1 holds the first 2 blocks of P (and 90% of P2) with 10 requests running; R2 is idle."""
    hasher = BlockHasher(block_size=B)
    router = make_router(["R1", "R2"], hasher=hasher)
    router.registry.update_from_heartbeat(
        heartbeat("R1", 0, hasher, running=10, queued_prefill_tokens=r1_queued), now=0.0
    )
    p2 = prompt(5, 320)  # 20 blocks
    router.index.add("R1", hasher.event_ints(p2)[:18])  # 288 of 320 tokens cached = 90%
    return router, p2


def test_request_matching_nothing_goes_to_the_idle_replica():
    router, _ = setup_r1_busy(r1_queued=0)
    d = decide(router, prompt(6, 320))
    # R1: 2 x 320 ms + 10 x 2 ms decode; R2: 2 x 320 ms.
    assert d.picked.replica_id == "R2"
    assert d.score_of("R1").cost == pytest.approx(0.660)
    assert d.score_of("R2").cost == pytest.approx(0.640)


def test_ninety_percent_cached_goes_to_r1_while_its_queue_is_short():
    # R1: q + 2 x 32 + 20 ms ; R2: 2 x 320 = 640 ms -> R1 wins while q < 556 tokens.
    router, p2 = setup_r1_busy(r1_queued=555)
    d = decide(router, p2)
    assert d.score_of("R1").cost == pytest.approx((555 + 64 + 20) / 1000)
    assert d.score_of("R2").cost == pytest.approx(0.640)
    assert d.picked.replica_id == "R1"
    assert d.predicted_cached_tokens == 288


def test_ninety_percent_cached_goes_to_r2_once_r1_queue_makes_it_slower():
    router, p2 = setup_r1_busy(r1_queued=557)
    d = decide(router, p2)
    assert d.score_of("R1").cost == pytest.approx((557 + 64 + 20) / 1000)
    assert d.picked.replica_id == "R2"


def test_longer_match_wins_in_every_insertion_order():
    hasher = BlockHasher(block_size=4)
    tokens = list(range(1, 25))  # 6 blocks of 4
    chain = hasher.event_ints(tokens)
    for order in (["R1", "R2"], ["R2", "R1"]):
        router = make_router(order, hasher=hasher)
        for rid in order:
            router.index.add(rid, chain[: 2 if rid == "R1" else 5])  # R1: 8 tokens, R2: 20 tokens
        d = decide(router, tokens)
        assert {s.candidate.replica_id: s.candidate.match.gpu * 4 for s in d.scored} == {"R1": 8, "R2": 20}
        assert d.picked.replica_id == "R2"


def test_tenants_with_different_cache_salt_never_share_blocks():
    hasher = BlockHasher(block_size=B)
    router = make_router(["R1", "R2"], hasher=hasher)
    tokens = prompt(11, 96)
    router.index.add("R1", hasher.event_ints(tokens, BlockHashKeys(cache_salt="tenant-a")))
    a = decide(router, tokens, "tenant-a")
    b = decide(router, tokens, "tenant-b")
    plain = decide(router, tokens)
    assert a.score_of("R1").candidate.match.gpu == 6
    assert b.score_of("R1").candidate.match.gpu == 0
    assert plain.score_of("R1").candidate.match.gpu == 0
    assert a.block_hashes[1:] != b.block_hashes[1:]  # the salt on block 0 changes the whole chain


def test_replica_with_another_block_size_or_seed_is_not_routable_and_says_why():
    hasher = BlockHasher(block_size=B)
    router = make_router(["R1"], hasher=hasher)
    bad_bs = heartbeat("R2", 1, hasher, block_size=32)
    bad_seed = heartbeat("R3", 2, BlockHasher(seed="other", block_size=B))
    router.registry.update_from_heartbeat(bad_bs, now=0.0)
    router.registry.update_from_heartbeat(bad_seed, now=0.0)
    assert [r.replica_id for r in router.registry.routable()] == ["R1"]
    assert "block_size" in router.registry.get("R2").reason and "32" in router.registry.get("R2").reason
    assert "seed" in router.registry.get("R3").reason
    assert decide(router, prompt(1, 64)).picked.replica_id == "R1"


def test_burst_sharing_a_new_prefix_lands_on_one_replica_through_speculative_entries():
    router = make_router(["R1", "R2", "R3"], seed=3)
    prefix = prompt(42, 512)
    picks = [route(router, prefix + prompt(100 + i, 16)) for i in range(30)]
    # Request k on the first replica: (528 + 16 (k - 1)) + 2 x 16 vs 2 x 528 elsewhere: stays put.
    assert len(set(picks)) == 1


def test_a_commit_after_the_replica_was_removed_does_not_put_it_back_in_the_index():
    router = make_router(["R1"])
    d = router.decide(prompt(5, 64))
    assert d.picked.replica_id == "R1"
    router.registry.expire("R1")  # the consumer thread, between decide and commit
    router.index.remove_replica("R1")
    router.commit(d)
    assert router.index.replicas == []  # no phantom bit and empty maps left behind


def test_a_withdrawn_decision_leaves_no_predicted_cached_tokens_for_its_prefix():
    router = make_router(["R1"])
    refused = prompt(8, 640)
    d = service(router).route(refused).decision
    assert decide(router, refused[:320]).predicted_cached_tokens == 320 - B  # credited speculatively
    service(router).withdraw(d)  # the replica refused it
    assert decide(router, refused[:320]).predicted_cached_tokens == 0


def test_a_withdrawn_decision_leaves_the_prefix_it_shares_with_a_request_still_waiting():
    router = make_router(["R1"])
    shared = prompt(9, 320)  # 20 blocks
    refused = service(router).route(shared + prompt(10, 320))
    service(router).route(shared + prompt(11, 320))  # a burst: both credited to R1, both held
    service(router).withdraw(refused.decision)  # R1 refused the first one
    service(router).finish(refused.ticket)  # as the proxy does after a withdrawal
    probe = shared + prompt(12, 16)  # 21 blocks, the last one new
    assert decide(router, probe).predicted_cached_tokens == 320  # the waiting request's hold of the 20
    assert decide(router, shared + prompt(10, 320)).predicted_cached_tokens == 320  # its own 20 are gone


def test_no_routable_replica_gives_no_pick_and_a_reason():
    router = make_router([])
    d = decide(router, prompt(1, 40))
    assert d.picked is None and "no replica" in d.reason


def test_the_decision_path_costs_equal_the_scorers_sum_bit_for_bit():
    """KVRoutePolicy.costs writes the default scorers' sum out inline; it must not drift from
    them (ties are exact float equality)."""
    from router.index import Match
    from router.scoring import DEFAULT_SCORERS, Candidate, RequestShape

    rng = random.Random(7)
    weights = ScoringWeights(prefill_tokens_per_s=1234.5, decode_seconds_per_running=0.0031, prefill_work_weight=2.5,
                             cpu_match_weight=0.3, kv_footprint_weight=1.7, kv_usage_weight=0.07,
                             in_flight_weight=0.011)
    cands = [
        Candidate(f"r{i}", Match(gpu=rng.randrange(40), cpu=rng.randrange(10)), queued_prefill_tokens=rng.randrange(5000),
                  running=rng.randrange(50), in_flight=rng.randrange(9), kv_usage=rng.random(),
                  prefill_tokens_per_s=rng.choice([0.0, rng.uniform(100, 1e5)]),
                  decode_seconds_per_running=rng.choice([0.0, rng.uniform(1e-4, 0.05)]), waiting=rng.randrange(20))
        for i in range(200)
    ]
    measured = ScoringWeights(prefill_work_weight=2.5, cpu_match_weight=0.3, kv_footprint_weight=0.4,
                              kv_usage_weight=0.07)
    for req, w in itertools.product((RequestShape(512, 16), RequestShape(1, 16), RequestShape(100, 4)),
                                    (weights, measured)):
        fast = KVRoutePolicy(w)
        wrapped = {name: functools.partial(fn) for name, fn in DEFAULT_SCORERS.items()}
        slow = KVRoutePolicy(w, scorers=wrapped)  # not the defaults: one call per scorer
        expected = [fast.score(c, req).cost for c in cands]
        assert fast.costs(cands, req) == expected
        assert slow.costs(cands, req) == expected


MEASURED = ScoringWeights(prefill_work_weight=1.0, kv_footprint_weight=0.0)  # rates from the replicas' heartbeats


def test_every_replica_is_costed_at_the_pools_median_measured_rates():
    hasher = BlockHasher(block_size=B)
    router = make_router(["R1", "R2", "R3", "R4"], weights=MEASURED, hasher=hasher)
    measured = {"R1": (4000.0, 0.001), "R2": (1000.0, 0.003), "R3": (2000.0, 0.0)}  # R4: nothing yet
    for i, (rid, (rate, step)) in enumerate(measured.items()):
        router.registry.update_from_heartbeat(heartbeat(rid, i, hasher, running=10 if rid == "R1" else 0,
                                                        prefill_tokens_per_s=rate, decode_seconds_per_running=step),
                                              now=0.0)
    d = decide(router, prompt(8, 320))
    # Medians of what was measured (> 0): 2,000 tokens/s of (1,000, 2,000, 4,000); 2 ms of (1, 3).
    # R1: 2 x 320 / 2,000 + 10 x 2 ms; the others 2 x 320 / 2,000.
    assert d.score_of("R1").cost == pytest.approx(0.340)
    assert [d.score_of(r).cost for r in ("R2", "R3", "R4")] == [pytest.approx(0.320)] * 3
    assert d.picked.replica_id != "R1"


def test_rate_settings_override_what_the_replicas_measured():
    hasher = BlockHasher(block_size=B)
    p = prompt(8, 320)
    for weights, picked in ((MEASURED, "R1"), (WEIGHTS, "R2")):
        router = make_router(["R1", "R2"], weights=weights, hasher=hasher)
        router.registry.update_from_heartbeat(heartbeat("R1", 0, hasher, running=40, prefill_tokens_per_s=4000.0,
                                                        decode_seconds_per_running=0.0001), now=0.0)
        router.registry.update_from_heartbeat(heartbeat("R2", 1, hasher, prefill_tokens_per_s=1000.0,
                                                        decode_seconds_per_running=0.0001), now=0.0)
        router.index.add("R1", hasher.event_ints(p)[:2])  # 32 of the 320 tokens
        d = decide(router, p)
        # Measured, the medians 2,500 tokens/s and 0.1 ms: R1 2 x 288 / 2,500 + 40 x 0.1 ms = 0.2344 s
        # against R2 2 x 320 / 2,500 = 0.256 s. At the settings (1,000 tokens/s, 2 ms a running
        # sequence): R1 0.576 + 0.080 = 0.656 s against R2 0.640 s.
        assert d.picked.replica_id == picked


def test_a_heartbeat_with_a_non_finite_rate_is_not_routable():
    hasher = BlockHasher(block_size=B)
    router = make_router(["R1"], hasher=hasher)
    router.registry.update_from_heartbeat(heartbeat("R2", 1, hasher, prefill_tokens_per_s="inf"), now=0.0)
    assert [r.replica_id for r in router.registry.routable()] == ["R1"]
    assert "prefill_tokens_per_s='inf'" in router.registry.get("R2").reason


@pytest.mark.parametrize(("waiting", "picked"), [(0, "R2"), (100, "R1")])
def test_on_backlogged_replicas_the_prefix_outweighs_the_shorter_queue(waiting, picked):
    router, p2 = setup_r1_busy(r1_queued=5000)  # R1 holds 288 of P2's 320 tokens
    hasher = BlockHasher(block_size=B)
    router.registry.update_from_heartbeat(heartbeat("R1", 0, hasher, queued_prefill_tokens=5000, waiting=waiting),
                                          now=0.0)
    router.registry.update_from_heartbeat(heartbeat("R2", 1, hasher, queued_prefill_tokens=3000, waiting=waiting),
                                          now=0.0)
    d = decide(router, p2)
    # Each uncached token weighs 1 + waiting more: R1 (5,000 + 32) + (1 + w) x 32 ms against
    # R2 (3,000 + 320) + (1 + w) x 320 ms. w = 0: 5.064 s against 3.640 s; w = 100: 8.264 against 35.640.
    assert d.score_of("R1").cost == pytest.approx((5032 + (1 + waiting) * 32) / 1000)
    assert d.score_of("R2").cost == pytest.approx((3320 + (1 + waiting) * 320) / 1000)
    assert d.picked.replica_id == picked


@pytest.mark.parametrize(("r1_usage", "picked"), [(0.5, "R1"), (0.9, "R2")])
def test_the_kv_footprint_term_moves_a_long_prompt_off_a_full_replica_but_not_a_short_one(r1_usage, picked):
    """R1 holds 16 of the 20 blocks of a 320-token prompt (R2 none), and its KV usage is
    ``r1_usage``; R2 is empty. Weights: work 1, footprint 2, 1,000 tokens/s. R1: (64 + 64) ms of
    prefill and work + 2 x usage x 320 ms of footprint; R2: (320 + 320) ms."""
    hasher = BlockHasher(block_size=B)
    weights = ScoringWeights(prefill_tokens_per_s=1000.0, decode_seconds_per_running=0.0, prefill_work_weight=1.0,
                             kv_footprint_weight=2.0)
    router = make_router(["R1", "R2"], weights=weights, hasher=hasher)
    router.registry.update_from_heartbeat(heartbeat("R1", 0, hasher, usage=r1_usage), now=0.0)
    long_prompt = prompt(3, 320)
    router.index.add("R1", router.hasher.event_ints(long_prompt[:256]))
    d = decide(router, long_prompt)
    assert d.score_of("R1").cost == pytest.approx(0.128 + 2 * r1_usage * 0.320)  # 0.448 or 0.704
    assert d.score_of("R2").cost == pytest.approx(0.640)
    assert d.picked.replica_id == picked
    # A 33-token prompt whose two blocks R1 holds stays there at either usage: 1 + 1 ms of prefill
    # and work + 2 x usage x 33 ms of footprint (35 or 61.4 ms) against 2 x 33 = 66 ms on R2.
    d = decide(router, long_prompt[:33])
    assert d.score_of("R1").cost == pytest.approx((2 + 2 * r1_usage * 33) / 1000)
    assert d.score_of("R2").cost == pytest.approx(0.066)
    assert d.picked.replica_id == "R1"


# -- what the routing service adds around the decision (every front goes through it) ---------------
def test_the_service_leaves_out_replicas_without_an_address():
    hasher = BlockHasher(block_size=B)
    router = make_router(["R1", "R2"], hasher=hasher)
    router.registry.update_from_heartbeat(heartbeat("R1", 0, hasher, address=""), now=0.0)
    tokens = prompt(20, 64)
    router.index.add("R1", hasher.event_ints(tokens))  # R1 holds the whole prompt, but nothing can dial it
    assert [route(router, prompt(20 + i, 64)) for i in range(4)] == ["R2"] * 4
    router.registry.expire("R2")
    with pytest.raises(NoReplicaError) as err:
        route(router, tokens)
    assert err.value.decision is not None and err.value.decision.picked is None
    assert "no replica is routable" in str(err.value)


def test_the_service_skips_full_queues_and_sheds_when_every_queue_is_full():
    hasher = BlockHasher(block_size=B)
    router = make_router(["R1", "R2"], hasher=hasher)
    tokens = prompt(21, 160)
    router.index.add("R1", hasher.event_ints(tokens))  # R1 would win: 0 uncached tokens
    assert decide(router, tokens).picked.replica_id == "R1"
    router.registry.update_from_heartbeat(heartbeat("R1", 0, hasher, waiting=4, max_waiting=4), now=0.0)
    routing = service(router)
    routed = routing.route(tokens)
    assert routed.replica.replica_id == "R2"  # R1 would answer RESOURCE_EXHAUSTED: the pick skips it
    routing.finish(routed.ticket)
    later = time.time() + 1.0  # a heartbeat written after that request finished
    router.registry.update_from_heartbeat(heartbeat("R2", 1, hasher, waiting=7, max_waiting=7, ts=later), now=0.0)
    with pytest.raises(QueuesFullError) as err:
        routing.route(tokens)
    assert str(err.value) == "every replica's waiting queue is full (R1 4/4, R2 7/7); retry later"
    assert classify_error(err.value)[0] == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert router.load.totals("R1") == (0, 0) and router.load.totals("R2") == (0, 0)  # nothing committed
    # A request on R1 that finishes after R1's heartbeat was written: that heartbeat's queue is stale.
    earlier = router.load.begin("R1", 16)  # routed to R1 before its queue filled up
    routing.finish(earlier)
    assert routing.route(tokens).replica.replica_id == "R1"


def test_the_service_keeps_the_pick_inside_the_subset_and_names_an_empty_or_ineligible_one():
    hasher = BlockHasher(block_size=B)
    router = make_router(["R1", "R2", "R3"], hasher=hasher)
    tokens = prompt(22, 160)
    router.index.add("R1", hasher.event_ints(tokens))
    r3 = router.registry.get("R3").address
    assert service(router).route(tokens, subset=[r3]).replica.replica_id == "R3"
    with pytest.raises(NoReplicaError, match="^the endpoint subset is empty$"):
        service(router).route(tokens, subset=[])
    with pytest.raises(NoReplicaError, match=r"^no replica of the subset 10\.9\.9\.9:1 is routable$"):
        service(router).route(tokens, subset=["10.9.9.9:1"])


def test_the_service_counts_the_pick_at_route_and_releases_it_at_finish():
    router = make_router(["R1", "R2"], seed=2)
    tokens = prompt(23, 100)
    routed = service(router).route(tokens, exclude=["R1"])
    assert routed.replica.replica_id == "R2"
    assert router.load.totals("R2") == (1, 100)  # in flight, uncached prompt tokens pending
    service(router).prefill_done(routed.ticket)
    assert router.load.totals("R2") == (1, 0)
    service(router).finish(routed.ticket)
    service(router).finish(routed.ticket)  # idempotent: exactly once
    assert router.load.totals("R2") == (0, 0)


def test_the_service_checks_the_request_before_routing_and_names_the_field():
    router = make_router(["R1"])
    router.registry.update_from_heartbeat(heartbeat("R1", 0, BlockHasher(block_size=B), max_model_len=64), now=0.0)
    too_long = gen_pb.GenerateRequest(token_ids=gen_pb.TokenIds(ids=prompt(24, 64)))
    with pytest.raises(InvalidRequestError) as err:
        service(router).checked_ids(too_long)
    assert classify_error(err.value)[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert "64" in str(err.value)
    with pytest.raises(InvalidRequestError, match="policy"):
        service(router).set_policy("fastest")
    assert router.load.totals("R1") == (0, 0)
