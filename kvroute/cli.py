"""The ``kvroute`` command line (``python -m kvroute``).

Subcommands import the replica or router packages lazily, so that ``kvroute`` itself stays free of
torch (DESIGN.md §1).

    kvroute demo [--requests N] [--replicas K]   replay the bundled Mooncake trace through K real
                                                 KV cache managers: round robin vs longest prefix
    kvroute replica [--flag ...]                 run one replica (gRPC + engine + KV events); its
                                                 flags are ReplicaSettings' (kvroute replica --help)
"""

from __future__ import annotations

import argparse
import random
import sys
import time


def _demo(args: argparse.Namespace) -> int:
    from kvroute.hashing import BlockHasher
    from kvroute.trace import BUNDLED_TRACE, TraceTokenizer, hit_rate_bounds, load_mooncake
    from replica.kv import KVCacheManager, SimpleKVRequest

    requests = load_mooncake(args.trace or BUNDLED_TRACE, limit=args.requests)
    tok = TraceTokenizer(tokens_per_block=args.block_size, vocab_size=32000)
    prompts = [tok.token_ids(r) for r in requests]
    bounds = hit_rate_bounds(requests, args.replicas)
    hasher = BlockHasher(block_size=args.block_size)
    print(
        f"kvroute demo: the first {len(requests)} requests of {BUNDLED_TRACE.name if not args.trace else args.trace}"
        f" ({sum(map(len, prompts)):,} prompt tokens, {args.block_size} tokens per trace block) through"
        f" {args.replicas} KV cache managers of {args.num_blocks:,} blocks each (block_size {args.block_size})."
    )
    print("Each request is looked up, allocated and freed on the chosen replica (no model forward).\n")
    rows = []
    for policy in ("round_robin", "longest_prefix"):
        managers = [
            KVCacheManager(args.num_blocks, args.block_size, hasher, max_model_len=None) for _ in range(args.replicas)
        ]
        counts = [0] * args.replicas
        rng = random.Random(0)
        t0 = time.perf_counter()
        for i, ids in enumerate(prompts):
            if policy == "round_robin":
                r = i % args.replicas
                req = SimpleKVRequest(f"r{i}", list(ids))
                hit = managers[r].get_computed_blocks(req)
            else:
                # Longest cached prefix among replicas under a bounded load (at most (1 + eps) x the
                # mean share, as in consistent hashing with bounded loads, Mirrokni et al. 2018);
                # ties -> fewest requests, then random. The router (issue 5) replaces this with its
                # TTFT cost model.
                req = SimpleKVRequest(f"r{i}", list(ids))
                cap = (1 + args.load_slack) * (i + 1) / args.replicas
                allowed = [k for k in range(args.replicas) if counts[k] + 1 <= cap] or list(range(args.replicas))
                lookups = {k: managers[k].get_computed_blocks(req) for k in allowed}
                best = max(lk.num_computed_tokens for lk in lookups.values())
                cands = [k for k, lk in lookups.items() if lk.num_computed_tokens == best]
                fewest = min(counts[k] for k in cands)
                r = rng.choice([k for k in cands if counts[k] == fewest])
                hit = lookups[r]
            m = managers[r]
            if m.allocate_slots(req, len(ids) - hit.num_computed_tokens, hit.num_computed_tokens, hit) is None:
                print(f"request {i} does not fit in {args.num_blocks} blocks; raise --num-blocks", file=sys.stderr)
                return 2
            m.free(req)
            counts[r] += 1
        dt = time.perf_counter() - t0
        q = sum(m.stats.queries for m in managers)
        h = sum(m.stats.hits for m in managers)
        rows.append((policy, h / q, "/".join(str(c) for c in counts), len(prompts) / dt))
    print(f"{'policy':<16}{'prefix cache hit rate':>22}{'requests per replica':>24}{'replayed req/s':>16}")
    for policy, rate, share, rps in rows:
        print(f"{policy:<16}{rate:>22.3f}{share:>24}{rps:>16.0f}")
    print(f"\nbounds from the hash ids alone (infinite caches): ideal {bounds['ideal']:.3f},"
          f" round robin over {args.replicas} {bounds['round_robin']:.3f}")
    print("The hit rates are measured by the managers themselves (tokens hit / tokens queried).")
    return 0


def _replica(args: argparse.Namespace) -> int:
    from replica.server import main as replica_main

    return replica_main(args.passthrough, prog="kvroute replica")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvroute", description="Prefix-aware routing cluster for LLM inference.")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="replay the bundled trace through real KV cache managers")
    d.add_argument("--trace", default=None, help="a Mooncake-format trace (default: the bundled one)")
    d.add_argument("--requests", type=int, default=1000, help="how many trace requests (default 1000)")
    d.add_argument("--replicas", type=int, default=4)
    d.add_argument("--block-size", type=int, default=16, help="KV block size = tokens per trace block")
    d.add_argument("--num-blocks", type=int, default=8192, help="KV blocks per replica")
    d.add_argument("--load-slack", type=float, default=0.1, help="bounded-load slack for longest_prefix")
    d.set_defaults(func=_demo)
    # The replica's flags are declared by ReplicaSettings, which imports torch: they are parsed by
    # the replica itself (replica.server.main), so that `kvroute --help` stays torch-free.
    r = sub.add_parser("replica", add_help=False, help="run one replica (flags: kvroute replica --help)")
    r.set_defaults(func=_replica, passthrough=[])
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.func is _replica:
        args.passthrough = rest
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
