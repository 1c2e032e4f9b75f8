"""``kvroute demo``: the bundled trace through K in-process KV cache managers, routed by the router's
own policies (``router.scoring``), with no model, no network and no clock.

    trace ──TraceTokenizer──▶ prompt ──▶ every manager's get_computed_blocks (its exact cached prefix)
                                      ──▶ one Candidate per manager (router.scoring): match = that
                                          prefix, load = the simulated in-flight window
                                      ──▶ policy.choose ──▶ allocate_slots + free on the pick

The candidates carry the managers' exact prefixes (what the router's index tracks from their KV
events). Each request is allocated and freed at once, so load is simulated, as a closed loop of
``concurrency`` requests: the last ``concurrency`` routed requests count as running on their
replicas, their uncached prompt tokens as queued prefill. This is the demo's load model, not the
router's: the decision itself is ``router.scoring``'s. The hit rates are the managers' own counters
(tokens hit / tokens queried, counted at allocation).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import deque
from dataclasses import dataclass

from kvroute.hashing import BlockHasher
from kvroute_tools.trace import BUNDLED_TRACE, TraceTokenizer, hit_rate_bounds, load_mooncake
from replica.kv import KVCacheManager, SimpleKVRequest
from router.index import Match
from router.scoring import Candidate, RequestShape, ScoringWeights, make_policy

DEMO_POLICIES = ("round_robin", "kvroute")


@dataclass(frozen=True)
class DemoRow:
    """One policy's replay: hit rate in tokens (0..1), requests per replica, replayed requests/s."""

    policy: str
    hit_rate: float
    per_replica: tuple[int, ...]
    requests_per_s: float


class DemoError(RuntimeError):
    """A request does not fit in a manager (the message says which flag to raise)."""


def replay(prompts: list[list[int]], policy_name: str, *, replicas: int, num_blocks: int, block_size: int,
           concurrency: int, weights: ScoringWeights | None = None, seed: int = 0) -> DemoRow:
    """Route each prompt (token ids) with ``policy_name`` over ``replicas`` fresh managers of
    ``num_blocks`` blocks of ``block_size`` tokens, allocating and freeing it on the pick; the last
    ``concurrency`` picks are the load the policy sees (module docstring).

    Raises:
        DemoError: a prompt needs more than ``num_blocks`` blocks.
        ValueError: ``policy_name`` is not one of router.scoring's policies.
    """
    policy = make_policy(policy_name, weights, seed=seed)
    hasher = BlockHasher(block_size=block_size)
    managers = [
        KVCacheManager(num_blocks, block_size, hasher, max_model_len=None, enable_kv_cache_events=False)
        for _ in range(replicas)
    ]
    ids = [f"replica-{k}" for k in range(replicas)]
    counts = [0] * replicas
    in_flight: deque[tuple[int, int]] = deque(maxlen=concurrency)  # (replica, uncached prompt tokens)
    t0 = time.perf_counter()
    for i, tokens in enumerate(prompts):
        req = SimpleKVRequest(f"r{i}", list(tokens))
        hits = [m.get_computed_blocks(req) for m in managers]
        queued, running = [0] * replicas, [0] * replicas
        for k, uncached in in_flight:
            queued[k] += uncached
            running[k] += 1
        cands = [Candidate(ids[k], Match(gpu=len(hits[k].blocks)), queued_prefill_tokens=queued[k],
                           running=running[k], in_flight=running[k]) for k in range(replicas)]
        pick, _ = policy.choose(cands, RequestShape(len(tokens), block_size))
        k = ids.index(pick.replica_id)
        hit = hits[k]
        if managers[k].allocate_slots(req, len(tokens) - hit.num_computed_tokens, hit.num_computed_tokens,
                                      hit) is None:
            raise DemoError(f"request {i} does not fit in {num_blocks} blocks; raise --num-blocks")
        managers[k].free(req)
        counts[k] += 1
        in_flight.append((k, len(tokens) - hit.num_computed_tokens))
    dt = time.perf_counter() - t0
    queries = sum(m.stats.queries for m in managers)
    hit_tokens = sum(m.stats.hits for m in managers)
    return DemoRow(policy_name, hit_tokens / queries if queries else 0.0, tuple(counts), len(prompts) / dt)


def demo_main(args: argparse.Namespace) -> int:
    """``kvroute demo``: print the table; 0, or 2 when a request does not fit (one line why)."""
    trace_path = args.trace or BUNDLED_TRACE
    requests = load_mooncake(trace_path, limit=args.requests)
    tok = TraceTokenizer(tokens_per_block=args.block_size, vocab_size=32000)
    prompts = [tok.token_ids(r) for r in requests]
    bounds = hit_rate_bounds(requests, args.replicas)
    print(
        f"kvroute demo: the first {len(requests)} requests of {args.trace or BUNDLED_TRACE.name}"
        f" ({sum(map(len, prompts)):,} prompt tokens, {args.block_size} tokens per trace block) through"
        f" {args.replicas} KV cache managers of {args.num_blocks:,} blocks each (block_size {args.block_size}),"
        f" routed by the router's policies (prefill work weight {args.prefill_work_weight:g})."
    )
    print("Each request is looked up, allocated and freed on the chosen replica (no model forward); the last"
          f" {args.concurrency} routed requests count as its load.\n")
    weights = ScoringWeights(prefill_work_weight=args.prefill_work_weight)
    rows = []
    for name in DEMO_POLICIES:
        try:
            rows.append(replay(prompts, name, replicas=args.replicas, num_blocks=args.num_blocks,
                               block_size=args.block_size, concurrency=args.concurrency, weights=weights))
        except DemoError as e:
            print(f"kvroute demo: {e}", file=sys.stderr)
            return 2
    print(f"{'policy':<16}{'prefix cache hit rate':>22}{'requests per replica':>24}{'replayed req/s':>16}")
    for row in rows:
        share = "/".join(map(str, row.per_replica))
        print(f"{row.policy:<16}{row.hit_rate:>22.3f}{share:>24}{row.requests_per_s:>16.0f}")
    print(f"\nbounds from the hash ids alone (infinite caches): ideal {bounds['ideal']:.3f},"
          f" round robin over {args.replicas} {bounds['round_robin']:.3f}")
    print("The hit rates are measured by the managers themselves (tokens hit / tokens queried).")
    return 0


__all__ = ["DEMO_POLICIES", "DemoError", "DemoRow", "demo_main", "replay"]
