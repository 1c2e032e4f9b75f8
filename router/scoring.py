"""The default cost model's math (DESIGN.md §5): candidates, weights, scorers. Pure functions, no I/O.

The default policy, ``kvroute`` (``router.policies.kvroute``), estimates each replica's time to first token for this request::

    cost(r) = (queued_prefill_tokens(r) + uncached_tokens(r)) / prefill_tokens_per_s(r)   # TTFT: queue + own prefill
            + running(r) * decode_seconds_per_running(r)                                  # TTFT: decode load
            + (prefill_work_weight + backlog_work_weight * waiting(r))
              * uncached_tokens(r) / prefill_tokens_per_s(r)                              # work added to the cluster
            + kv_footprint_weight * kv_usage(r) * prompt_tokens / prefill_tokens_per_s(r) # KV pressure
            + kv_usage(r) * kv_usage_weight + in_flight(r) * in_flight_weight             # optional terms

    uncached_tokens(r) = prompt_tokens - block_size * (gpu_blocks(r) + cpu_match_weight * cpu_blocks(r))

and picks the lowest cost; exact ties are broken at random (seeded), never by list position.

The rates: ``prefill_tokens_per_s(r)`` and ``decode_seconds_per_running(r)`` are the medians,
over the routable replicas, of what each measured over its recent steps and published in its
heartbeat (``replica.engine.step_rates``, :func:`pool_rate`), so the cost reads in seconds of the
pool's hardware. The median, not each replica's own, because a replica's rate also reflects its
own mix of work, and charging each at its own steers work to whichever looked fast. A setting
(``--prefill-tokens-per-s``, ``--decode-seconds-per-running``) overrides them for every replica;
before any replica has measured, ``DEFAULT_PREFILL_TOKENS_PER_S`` and
``DEFAULT_DECODE_SECONDS_PER_RUNNING`` stand in.

Why each term beyond TTFT (DESIGN.md §5; the defaults come from the sweeps in docs/results.md):
- work: TTFT alone sends a second request sharing a prefix still being prefilled elsewhere to an
  idle replica, so a burst computes its prefix once per replica; charging the prefill a request
  adds to the cluster keeps it where the prefix is until that queue outgrows the work saved.
- backlog: on a replica with a backlog the added prefill also delays every request arriving there
  before it clears, about its waiting queue by Little's law, so an overloaded cluster keeps
  prefixes instead of trading them for a momentarily shorter queue.
- KV footprint: a request pins its prompt's blocks, and ``kv_usage`` is about how likely each is to
  push out a cached block of another request; the term charges the recompute of that eviction, in
  proportion to the prompt, so a short prompt is not moved off its prefix (as the fixed
  ``kv_usage_weight``, off by default, would) because its replica was busy at its last heartbeat.

Each term is a small scorer ``(candidate, request, weights) -> seconds`` in ``DEFAULT_SCORERS``;
a deployment can reweight or replace them. The policies that use this module live in
``router.policies`` (which imports it; it imports no policy).
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from router.index import Match
from router.weights import ScoringWeights

DEFAULT_PREFILL_TOKENS_PER_S = 20000.0
"""Prefill rate, tokens/s, of a replica that has published no measurement (nor a setting given)."""
DEFAULT_DECODE_SECONDS_PER_RUNNING = 0.002
"""TTFT added per running sequence, seconds, likewise."""


@dataclass(frozen=True)
class RequestShape:
    """What scoring needs of a request: its prompt length and block size, in tokens."""

    prompt_tokens: int
    block_size: int


@dataclass(slots=True)
class Candidate:
    """A routable replica as the scorers see it."""

    replica_id: str
    match: Match = field(default_factory=Match)
    queued_prefill_tokens: int = 0  # prompt tokens waiting to be computed there (heartbeat + routers)
    running: int = 0
    in_flight: int = 0  # requests the routers have sent and not seen finish
    kv_usage: float = 0.0
    prefill_tokens_per_s: float = 0.0  # measured by the replica (heartbeat); 0 = not measured
    decode_seconds_per_running: float = 0.0  # likewise
    waiting: int = 0  # requests in the replica's waiting queue (heartbeat)

    def cached_tokens(self, req: RequestShape) -> int:
        """Tokens of this request the replica is predicted to serve from its prefix cache (GPU+CPU).
        The engine looks up at most ``(prompt_tokens - 1) // block_size`` blocks (its last prompt
        token is always recomputed), hence the cap."""
        max_blocks = max(req.prompt_tokens - 1, 0) // req.block_size
        return min(self.match.gpu + self.match.cpu, max_blocks) * req.block_size


Scorer = Callable[[Candidate, RequestShape, ScoringWeights], float]


def pool_rate(measured: Iterable[float]) -> float:
    """The median of the replicas' measured values that are > 0 (0 when none is): what the router
    charges every replica at (module docstring)."""
    values = [v for v in measured if v > 0]
    return statistics.median(values) if values else 0.0


def prefill_rate(c: Candidate, w: ScoringWeights) -> float:
    """Tokens/s the cost charges prefill at on ``c``: the setting, else the replica's measured
    rate, else :data:`DEFAULT_PREFILL_TOKENS_PER_S`."""
    if w.prefill_tokens_per_s is not None:
        return w.prefill_tokens_per_s
    return c.prefill_tokens_per_s if c.prefill_tokens_per_s > 0 else DEFAULT_PREFILL_TOKENS_PER_S


def decode_step_seconds(c: Candidate, w: ScoringWeights) -> float:
    """Seconds per running sequence on ``c``: the setting, else the measured, else
    :data:`DEFAULT_DECODE_SECONDS_PER_RUNNING`."""
    if w.decode_seconds_per_running is not None:
        return w.decode_seconds_per_running
    return c.decode_seconds_per_running if c.decode_seconds_per_running > 0 else DEFAULT_DECODE_SECONDS_PER_RUNNING


def uncached_tokens(c: Candidate, req: RequestShape, w: ScoringWeights) -> float:
    """Prompt tokens the replica must compute: a GPU block saves its tokens, a CPU-tier block
    ``cpu_match_weight`` of them; the last prompt token is always computed."""
    saved = req.block_size * (c.match.gpu + w.cpu_match_weight * c.match.cpu)
    return max(req.prompt_tokens - saved, 1.0)


def prefix_queue_scorer(c: Candidate, req: RequestShape, w: ScoringWeights) -> float:
    """Seconds to prefill what is queued on the replica plus this request's uncached tokens."""
    return (c.queued_prefill_tokens + uncached_tokens(c, req, w)) / prefill_rate(c, w)


def prefill_work_scorer(c: Candidate, req: RequestShape, w: ScoringWeights) -> float:
    """The prefill this request adds to the cluster, in seconds, weighted (module docstring)."""
    weight = w.prefill_work_weight + w.backlog_work_weight * c.waiting
    return weight * uncached_tokens(c, req, w) / prefill_rate(c, w)


def decode_scorer(c: Candidate, req: RequestShape, w: ScoringWeights) -> float:
    """Decode interference: each running sequence shares the step with our prefill."""
    return c.running * decode_step_seconds(c, w)


def kv_footprint_scorer(c: Candidate, req: RequestShape, w: ScoringWeights) -> float:
    """The prefill seconds of the prompt's whole footprint, weighted, times the replica's KV usage:
    the expected cost of the cached blocks its blocks push out (module docstring)."""
    return w.kv_footprint_weight * c.kv_usage * req.prompt_tokens / prefill_rate(c, w)


def kv_usage_scorer(c: Candidate, req: RequestShape, w: ScoringWeights) -> float:
    return c.kv_usage * w.kv_usage_weight


def in_flight_scorer(c: Candidate, req: RequestShape, w: ScoringWeights) -> float:
    return c.in_flight * w.in_flight_weight


DEFAULT_SCORERS: dict[str, Scorer] = {
    "prefix_queue": prefix_queue_scorer,
    "decode": decode_scorer,
    "prefill_work": prefill_work_scorer,
    "kv_footprint": kv_footprint_scorer,
    "kv_usage": kv_usage_scorer,
    "in_flight": in_flight_scorer,
}


@dataclass(slots=True)
class Scored:
    """One candidate's cost (seconds; lower is better); per scorer too when asked for
    (``KVRoutePolicy.score``), None on the decision path, which only needs the total."""

    candidate: Candidate
    cost: float
    terms: dict[str, float] | None = None


def pick_lowest(scored: Sequence[Scored], rng: random.Random) -> Candidate | None:
    """The candidate of lowest cost; exact ties at random, never by list position (None when there
    is no candidate). A single best draws nothing from ``rng``."""
    if not scored:
        return None
    best = min(s.cost for s in scored)
    ties = [s.candidate for s in scored if s.cost == best]
    return ties[0] if len(ties) == 1 else rng.choice(ties)
