"""Speculative index entries (router/speculative.py): what a routed request's credit costs, against
the real entries of the same blocks in the same run.

    python bench/speculative.py [--requests 2000] [--blocks 512] [--held 32]

- **memory per speculative entry**: tracemalloc's traced bytes (plus what the index's compiled
  tables hold, ``BlockIndex.table_bytes``: C allocations) after ``--requests`` credits of
  ``--blocks`` fresh hashes each over 64 replicas, each held (``Router.commit``) until ``--held``
  later ones were made and then released (its first token), the TTL long enough that none expires;
  the hashes' lists are the caller's (the Decision's), not counted. Baseline: the same blocks as real entries (``BlockIndex.add``).
- **hold + release, hold + withdraw** per request (``add_speculative(hold=True)`` then
  ``release_speculative`` or ``remove_speculative``), CPU time on this thread, median of 5
  rounds. Baseline: the same blocks through ``BlockIndex.add`` then ``BlockIndex.remove``
  (BlockStored, BlockRemoved).

No goal: holds must stay about as cheap as the real entries' path (DESIGN.md §5: holds are
counted per request, a hold count per (hash, replica) entry).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
import tracemalloc
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import print_table  # noqa: E402
from router.index import BlockIndex  # noqa: E402

REPLICAS = [f"r{i:02d}" for i in range(64)]


def memory_per_entry(chains: list[list[int]], held: int, speculative: bool) -> float:
    index = BlockIndex(speculative_ttl=1e9)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    window: deque = deque()
    for i, chain in enumerate(chains):
        replica = REPLICAS[i % len(REPLICAS)]
        if not speculative:
            index.add(replica, chain)
            continue
        window.append(index.add_speculative(replica, chain, hold=True))
        if len(window) > held:
            index.release_speculative(window.popleft())
    used = tracemalloc.get_traced_memory()[0] - base + index.table_bytes()  # C tables: not traced
    tracemalloc.stop()
    return used / sum(map(len, chains))


def us_per_request(chains: list[list[int]], how: str) -> float:
    index = BlockIndex(speculative_ttl=2.0)
    rounds = []
    for _ in range(5):
        t0 = time.thread_time()
        for i, chain in enumerate(chains):
            replica = REPLICAS[i % len(REPLICAS)]
            if how == "real":
                index.add(replica, chain)
                index.remove(replica, chain)
                continue
            credit = index.add_speculative(replica, chain, hold=True)
            (index.release_speculative if how == "release" else index.remove_speculative)(credit)
        rounds.append((time.thread_time() - t0) / len(chains) * 1e6)
    return statistics.median(rounds)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--blocks", type=int, default=512)
    p.add_argument("--held", type=int, default=32, help="requests held at once (waiting for their first token)")
    args = p.parse_args()
    rng = random.Random(1)
    chains = [[rng.getrandbits(64) for _ in range(args.blocks)] for _ in range(args.requests)]
    spec, real = memory_per_entry(chains, args.held, True), memory_per_entry(chains, args.held, False)
    timed = chains[:200]
    release, withdraw, events = (us_per_request(timed, how) for how in ("release", "withdraw", "real"))
    rows = [
        ("memory per speculative entry", f"{spec:.0f} B ({args.requests * args.blocks:,} entries, {args.held} held)",
         f"{real:.0f} B as real entries", f"{spec / real:.2f}x"),
        (f"hold + release, {args.blocks} blocks", f"{release:.0f} us", f"{events:.0f} us add + remove", f"{release / events:.2f}x"),
        (f"hold + withdraw, {args.blocks} blocks", f"{withdraw:.0f} us", f"{events:.0f} us add + remove", f"{withdraw / events:.2f}x"),
    ]
    print(f"speculative entries: {args.requests} requests of {args.blocks} fresh blocks over {len(REPLICAS)} replicas")
    print_table(("metric", "measured", "baseline (same run)", "ratio"), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
