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

A decision hands the policy a :class:`CandidateTable`: the candidates as the registry's records,
the index's matches and the routers' load, with a :class:`Candidate` made only for the items a
policy asks for. :func:`default_costs` over a table is one compiled pass (``router/_scoring.c``,
optional: without it, the same sum in a Python loop over Candidate objects).
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

from router.index import Match
from router.weights import ScoringWeights

try:
    from router import _scoring
except ImportError:  # built without a C compiler: default_costs' Python loop, pool_rate
    _scoring = None

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


def prefill_rate(c: Candidate | CandidateTable, w: ScoringWeights) -> float:
    """Tokens/s the cost charges prefill at on ``c``: the setting, else the replica's measured
    rate (a table's: the pool's), else :data:`DEFAULT_PREFILL_TOKENS_PER_S`."""
    if w.prefill_tokens_per_s is not None:
        return w.prefill_tokens_per_s
    return c.prefill_tokens_per_s if c.prefill_tokens_per_s > 0 else DEFAULT_PREFILL_TOKENS_PER_S


def decode_step_seconds(c: Candidate | CandidateTable, w: ScoringWeights) -> float:
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


class _MadeWhenRead(Sequence):
    """A sequence whose item ``i`` is made by ``_make(i)`` when first read, then kept."""

    def __init__(self, n: int):
        self._made: list[Any] = [None] * n

    def _make(self, i: int) -> Any:
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self._made)

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        item = self._made[i]
        if item is None:
            item = self._made[i] = self._make(i)
        return item

    def __iter__(self) -> Iterator[Any]:
        return (self[i] for i in range(len(self._made)))


class CandidateTable(_MadeWhenRead, Sequence[Candidate]):
    """One decision's candidates, kept as what they are made of (all snapshots of the moment):

    - ``infos``: the registry's records (``router.registry.ReplicaInfo``), in the decision's order;
    - ``matches``: ``{replica_id: Match}`` from the index (a replica absent matched nothing);
    - ``in_flight``, ``pending``: the routers' requests in flight and prompt tokens not yet
      prefilled per replica (absent: 0).

    Item ``i`` is the :class:`Candidate` of ``infos[i]``, made when first asked for: its queued
    prefill is the larger of the heartbeat's and the routers' pending (they overlap), and every
    candidate is charged the pool's medians of the measured rates (:func:`pool_rate`).
    :func:`default_costs` reads the columns without making any.
    """

    def __init__(self, infos: list[Any], matches: Mapping[str, Match], in_flight: Mapping[str, int],
                 pending: Mapping[str, int]):
        self.infos = infos
        self.matches = matches
        self.in_flight = in_flight
        self.pending = pending
        if _scoring is not None:
            self.prefill_tokens_per_s, self.decode_seconds_per_running = _scoring.pool_rates(infos)
        else:
            self.prefill_tokens_per_s = pool_rate(info.prefill_tokens_per_s for info in infos)
            self.decode_seconds_per_running = pool_rate(info.decode_seconds_per_running for info in infos)
        self._record_of: dict[int, Any] = {}
        super().__init__(len(infos))

    def _make(self, i: int) -> Candidate:
        info = self.infos[i]
        rid = info.replica_id
        c = Candidate(rid, self.matches.get(rid) or Match(), max(info.queued_prefill_tokens, self.pending.get(rid, 0)),
                      info.running, self.in_flight.get(rid, 0), info.usage, self.prefill_tokens_per_s,
                      self.decode_seconds_per_running, info.waiting)
        self._record_of[id(c)] = info  # (the table keeps c, so its id stays its own)
        return c

    def info_of(self, c: Candidate) -> Any:
        """The record ``c`` was made from (a candidate of this table; else the record of its
        replica id; ValueError: none)."""
        info = self._record_of.get(id(c))
        if info is None:
            info = self.infos[list(map(_REPLICA_ID, self.infos)).index(c.replica_id)]
        return info


_REPLICA_ID = attrgetter("replica_id")


class ScoredTable(_MadeWhenRead, Sequence[Scored]):
    """``Scored(cands[i], costs[i])`` for each candidate, made when first read (a decision reports
    every candidate's cost; most callers look at none of them)."""

    def __init__(self, cands: Sequence[Candidate], costs: list[float]):
        self.cands = cands
        self.costs = costs
        super().__init__(len(costs))

    def _make(self, i: int) -> Scored:
        return Scored(self.cands[i], self.costs[i])


def default_costs(cands: Sequence[Candidate], req: RequestShape, w: ScoringWeights) -> list[float]:
    """Every candidate's cost under ``DEFAULT_SCORERS``, equal to the sum of their terms bit for bit:
    the sum written out in their order (same float operations, no call per term). Over a
    :class:`CandidateTable`, one compiled pass over its columns when ``router._scoring`` is built
    (the same operations in C; no Candidate is made)."""
    prompt, block = req.prompt_tokens, req.block_size
    cpu_w, work_w, backlog_w = w.cpu_match_weight, w.prefill_work_weight, w.backlog_work_weight
    footprint_w, kv_w, flight_w = w.kv_footprint_weight, w.kv_usage_weight, w.in_flight_weight
    if _scoring is not None and isinstance(cands, CandidateTable):
        # The table carries the pool's measured rates under the Candidate's names.
        rate, decode_s = prefill_rate(cands, w), decode_step_seconds(cands, w)
        return _scoring.costs(cands.infos, cands.matches, cands.in_flight, cands.pending, prompt, block, rate,
                              decode_s, (work_w, backlog_w, cpu_w, footprint_w, kv_w, flight_w))
    out = []
    for c in cands:
        u = max(prompt - block * (c.match.gpu + cpu_w * c.match.cpu), 1.0)  # uncached_tokens
        rate, decode_s = prefill_rate(c, w), decode_step_seconds(c, w)
        out.append(
            0 + (c.queued_prefill_tokens + u) / rate + c.running * decode_s
            + (work_w + backlog_w * c.waiting) * u / rate
            + footprint_w * c.kv_usage * prompt / rate
            + c.kv_usage * kv_w + c.in_flight * flight_w
        )
    return out


def pick_lowest_cost(cands: Sequence[Candidate], costs: list[float], rng: random.Random) -> Candidate | None:
    """:func:`pick_lowest` over ``costs[i]`` of ``cands[i]`` without a Scored per candidate: the
    same pick and the same draws from ``rng``."""
    if not costs:
        return None
    best = min(costs)
    if best == best and costs.count(best) == 1:  # (count's identity shortcut: same as == but for NaN)
        return cands[costs.index(best)]
    ties = [cands[i] for i, cost in enumerate(costs) if cost == best]
    return ties[0] if len(ties) == 1 else rng.choice(ties)


def pick_lowest(scored: Sequence[Scored], rng: random.Random) -> Candidate | None:
    """The candidate of lowest cost; exact ties at random, never by list position (None when there
    is no candidate). A single best draws nothing from ``rng``."""
    return pick_lowest_cost([s.candidate for s in scored], [s.cost for s in scored], rng)
