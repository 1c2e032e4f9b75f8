"""Consistent hashing with bounded load (CHWBL), as KubeAI's ``PrefixHash`` load balancing.

Sources: Mirrokni, Thorup, Zadimoghaddam, "Consistent Hashing with Bounded Loads" (SODA 2018) and
KubeAI's load balancing docs and ``internal/loadbalancer`` (strategy ``PrefixHash``:
``meanLoadFactor`` 125%, ``replication`` 256 virtual nodes per endpoint, key = the prompt's first
``prefixCharLength`` characters). The key's hash is placed on a ring of virtual nodes; walking
clockwise, the request goes to the first endpoint whose in-flight load stays within
``ceil(load_factor * (total in flight + 1) / endpoints)``.

Where this simplifies: the key is the request's first ``prefix_blocks`` block hashes (given by
``observe_prompt`` before each decision) instead of characters; load is the router's in-flight
count; the ring uses blake2b of ``"replica#vnode"``.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import random
from collections.abc import Sequence

from router.policies.base import Policy
from router.scoring import Candidate, RequestShape, Scored, ScoringWeights


def _point(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


class BoundedLoadHashPolicy(Policy):
    """CHWBL over the candidates (module docstring). Cost = position of the replica on the walk."""

    name = "chwbl"
    observes_prompt = True

    def __init__(self, load_factor: float = 1.25, replication: int = 256, prefix_blocks: int = 1):
        if load_factor < 1:
            raise ValueError(f"load_factor: must be >= 1, got {load_factor}")
        self.load_factor, self.replication, self.prefix_blocks = load_factor, replication, prefix_blocks
        self._ring_of: tuple[str, ...] = ()
        self._points: list[int] = []
        self._owners: list[str] = []
        self._key = 0

    @classmethod
    def build(cls, weights: ScoringWeights | None, rng: random.Random) -> BoundedLoadHashPolicy:
        return cls()

    def observe_prompt(self, block_hashes: Sequence[int]) -> None:
        """The next request's hash chain (its first ``prefix_blocks`` hashes make the key)."""
        self._key = _point(",".join(map(str, block_hashes[: self.prefix_blocks])))

    def _ring(self, ids: tuple[str, ...]) -> None:
        if ids != self._ring_of:
            ring = sorted((_point(f"{rid}#{v}"), rid) for rid in ids for v in range(self.replication))
            self._points, self._owners, self._ring_of = [p for p, _ in ring], [r for _, r in ring], ids

    def choose(self, cands: Sequence[Candidate], req: RequestShape) -> tuple[Candidate | None, list[Scored]]:
        if not cands:
            return None, []
        by_id = {c.replica_id: c for c in cands}
        self._ring(tuple(sorted(by_id)))
        bound = math.ceil(self.load_factor * (sum(c.in_flight for c in cands) + 1) / len(cands))
        start = bisect.bisect_left(self._points, self._key)
        order: list[str] = []
        seen: set[str] = set()
        pick = None
        n = len(self._owners)
        for step in range(n):
            rid = self._owners[(start + step) % n]
            if rid in seen:
                continue
            seen.add(rid)
            order.append(rid)
            if pick is None and by_id[rid].in_flight + 1 <= bound:
                pick = by_id[rid]
            if len(order) == len(by_id):
                break
        rank = {rid: k for k, rid in enumerate(order)}
        return pick, [Scored(c, float(rank[c.replica_id])) for c in cands]
