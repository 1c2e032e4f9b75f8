"""The one interface every routing policy implements (DESIGN.md §5, §7): what the router and the
simulator call, and nothing else.

The router calls :meth:`Policy.choose` (and reads ``name``). ``kvroute simulate`` also drives the
hooks below, which default to "nothing to do", so a policy overrides only what it needs:

- ``index_from_kv_events`` / ``speculative_ttl``: False and a TTL for a policy whose "index" is
  its own routing history (the router's speculative entries, no KV events);
- ``observes_prompt`` / :meth:`Policy.observe_prompt`: True for a policy that wants the request's
  hash chain before ``choose``;
- :meth:`Policy.set_block_capacity`: blocks per replica, told by whoever knows it;
- :meth:`Policy.build`: how the registry (``router.policies.registry``) makes one from the
  router's settings.

Imports: router.scoring only (no I/O).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from router.scoring import Candidate, RequestShape, Scored, ScoringWeights


class Policy:
    """Chooses one candidate. ``choose`` returns the pick (None when there is no candidate) and
    every candidate's score (policies without a cost model report cost 0)."""

    name = "policy"
    index_from_kv_events: bool = True
    """False: the router's index gets no KV events, only this policy's routing history."""
    speculative_ttl: float | None = None
    """Seconds a speculative entry lives in this policy's index; None: the caller's setting."""
    observes_prompt: bool = False
    """True: call :meth:`observe_prompt` with each request's hash chain before :meth:`choose`."""

    @classmethod
    def build(cls, weights: ScoringWeights | None, rng: random.Random) -> Policy:
        """A policy of this class from the router's cost weights and a seeded generator for ties
        (the default uses the generator only)."""
        return cls(rng=rng)

    def choose(self, cands: Sequence[Candidate], req: RequestShape) -> tuple[Candidate | None, Sequence[Scored]]:
        raise NotImplementedError

    def observe_prompt(self, block_hashes: Sequence[int]) -> None:
        """The next request's hash chain (ints, the index's form); called when ``observes_prompt``."""

    def set_block_capacity(self, blocks: int) -> None:
        """Blocks of KV cache per replica (block 0 excluded); the default ignores it."""


__all__ = ["Policy"]
