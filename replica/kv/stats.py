"""The KV manager's prefix-cache counters (DESIGN.md §3.1), vLLM v1's ``PrefixCacheStats`` semantics."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PrefixCacheStats:
    """Prefix-cache counters in tokens, counted once per admission (vLLM's prefix cache hit rate).

    A request re-admitted after a preemption is counted apart (``preempted_*``), as vLLM does:
    querying its own prompt and outputs again, and hitting its own surviving blocks, is recompute,
    not prefix sharing, and would inflate ``queries`` and ``hits``.

    - ``queries`` / ``hits`` / ``cpu_hits`` / ``requests``: first admissions only (``cpu_hits`` is
      the part of ``hits`` served from the CPU tier).
    - ``preempted_requests`` / ``preempted_queries`` / ``preempted_hits``: re-admissions after a
      preemption (a request preempted twice counts twice).
    """

    queries: int = 0
    hits: int = 0
    cpu_hits: int = 0
    requests: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    @property
    def recomputed_tokens(self) -> int:
        """Tokens preempted requests computed again on re-admission (queried, not hit)."""
        return self.preempted_queries - self.preempted_hits

    def record(self, num_tokens: int, num_hits: int, num_cpu_hits: int, *, preempted: bool) -> None:
        """Count one admission of a request of ``num_tokens`` tokens whose first ``num_hits`` were
        cached (``num_cpu_hits`` of them on the CPU tier); ``preempted``: a re-admission."""
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
            return
        self.requests += 1
        self.queries += num_tokens
        self.hits += num_hits
        self.cpu_hits += num_cpu_hits
