"""In-flight load accounting, counted at selection and shared between routers (DESIGN.md §5).

A request adds to its replica's load the moment it is routed, before it is dispatched, so a burst
of concurrent requests spreads instead of piling onto the replica that looked idle. Its uncached
prompt tokens count as pending prefill until the first token comes back; the request counts as in
flight until it completes, fails or is cancelled. Several routers share their counts, with their
speculative index entries, as one :class:`RouterShare` each through Redis
(``router.load_sync.RedisLoadSync``), which reads and merges this state; this module does no I/O.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from router.speculative import SpeculativeCredit


@dataclass(eq=False)
class Ticket:
    """One routed request's share of its replica's load; release it exactly once per stage."""

    replica_id: str
    prefill_tokens: int
    prefill_done: bool = False
    finished: bool = False
    speculative: SpeculativeCredit | None = None  # its index credit (Router.commit), held until the prefill is done


@dataclass
class RouterShare:
    """What one router tells the others (``router.core.Router.share`` / ``merge``): per replica,
    its own ``(in_flight, pending_prefill_tokens)`` and its speculative entries the KV events have
    not brought yet (``BlockIndex.own_speculative``: hashes)."""

    load: dict[str, tuple[int, int]] = field(default_factory=dict)
    speculative: dict[str, Sequence[int]] = field(default_factory=dict)


class LoadTracker:
    """Per replica: requests in flight and prompt tokens not yet prefilled, local + other routers'.

    Thread-safe (the gRPC loop updates it, the sync thread reads and merges it). Besides this
    router's counts and each other router's, it keeps their sums per replica up to date (a
    decision reads every replica's: a copy of two dicts, not a merge).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._in_flight: Counter[str] = Counter()
        self._pending: Counter[str] = Counter()
        self._remote: dict[str, dict[str, tuple[int, int]]] = {}
        self._total_in_flight: dict[str, int] = {}  # local + remote, replicas at 0 left out
        self._total_pending: dict[str, int] = {}

    @staticmethod
    def _add(totals: dict[str, int], replica_id: str, delta: int) -> None:
        v = totals.get(replica_id, 0) + delta
        if v:
            totals[replica_id] = v
        else:
            totals.pop(replica_id, None)

    def begin(self, replica_id: str, prefill_tokens: int) -> Ticket:
        with self._lock:
            self._in_flight[replica_id] += 1
            self._pending[replica_id] += prefill_tokens
            self._add(self._total_in_flight, replica_id, 1)
            self._add(self._total_pending, replica_id, prefill_tokens)
        return Ticket(replica_id, prefill_tokens)

    def prefill_done(self, ticket: Ticket) -> None:
        """The first token arrived: the prompt is computed (idempotent)."""
        with self._lock:
            if not ticket.prefill_done:
                ticket.prefill_done = True
                r = ticket.replica_id
                before = self._pending[r]
                self._pending[r] -= ticket.prefill_tokens
                if self._pending[r] <= 0:
                    del self._pending[r]
                self._add(self._total_pending, r, self._pending.get(r, 0) - before)

    def finish(self, ticket: Ticket) -> None:
        """Completed, failed or cancelled (idempotent)."""
        self.prefill_done(ticket)
        with self._lock:
            if not ticket.finished:
                ticket.finished = True
                r = ticket.replica_id
                before = self._in_flight[r]
                self._in_flight[r] -= 1
                if self._in_flight[r] <= 0:
                    del self._in_flight[r]
                self._add(self._total_in_flight, r, self._in_flight.get(r, 0) - before)

    def local(self) -> dict[str, tuple[int, int]]:
        """This router's ``{replica: (in_flight, pending_prefill_tokens)}``."""
        with self._lock:
            keys = set(self._in_flight) | set(self._pending)
            return {r: (self._in_flight[r], self._pending[r]) for r in keys}

    def set_remote(self, router_id: str, counts: dict[str, tuple[int, int]] | None) -> None:
        with self._lock:
            old = self._remote.pop(router_id, None) if counts is None else self._remote.get(router_id)
            if counts is not None:
                self._remote[router_id] = counts
            for sign, part in ((-1, old), (1, counts)):
                for r, (f, p) in (part or {}).items():
                    self._add(self._total_in_flight, r, sign * f)
                    self._add(self._total_pending, r, sign * p)

    def remote_routers(self) -> list[str]:
        with self._lock:
            return list(self._remote)

    def all_totals(self) -> tuple[dict[str, int], dict[str, int]]:
        """(in_flight, pending_prefill_tokens) per replica over every router, a copy of each; a
        replica at 0 is absent (the decision path)."""
        with self._lock:
            return dict(self._total_in_flight), dict(self._total_pending)

    def totals(self, replica_id: str) -> tuple[int, int]:
        """(in_flight, pending_prefill_tokens) for ``replica_id`` over every router."""
        with self._lock:
            return self._total_in_flight.get(replica_id, 0), self._total_pending.get(replica_id, 0)


__all__ = ["LoadTracker", "RouterShare", "Ticket"]
