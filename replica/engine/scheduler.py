"""Continuous-batching scheduler with chunked prefill and preemption by recompute (vLLM v1).

One token budget per step (``max_num_batched_tokens``) is shared by decodes and prefill chunks;
there is no separate prefill phase: every request simply has ``num_tokens - num_computed_tokens``
tokens left to compute and gets as many as the budget allows (DESIGN.md §3.2).
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from replica.engine.request import Request, RequestStatus
from replica.kv import KVCacheManager


@dataclass(slots=True)
class ScheduledRequest:
    """A request's share of one step: ``num_scheduled_tokens`` tokens starting at ``start``."""

    request: Request
    start: int  # num_computed_tokens before this step
    num_scheduled_tokens: int
    block_ids: list[int]

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the request's tokens (a token is sampled)."""
        return self.start + self.num_scheduled_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    """What one step runs. ``scheduled`` lists running requests first, then new admissions."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_prefix_hit_tokens: int = 0  # tokens newly admitted requests got from the prefix cache

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    """Owns the waiting queue and the running list; decides each step's batch.

    Invariants: a running request holds blocks for all its computed tokens; a waiting request
    holds none (a preempted one freed them and will recompute from scratch, reusing whatever of
    its prefix is still cached); ``len(running) <= max_num_seqs``.

    Policy, per step (vLLM v1):
      1. running requests first, in order; each gets ``min(left, budget)`` tokens. When
         ``allocate_slots`` fails, the *last* running request is preempted (blocks freed,
         ``num_computed_tokens = 0``, front of the waiting queue), until the allocation fits or
         the request itself was the one preempted.
      2. only if nothing was preempted this step: admit waiting requests in FIFO order while the
         budget, ``max_num_seqs`` and free blocks allow, each with its prefix-cache hit.
    """

    def __init__(self, kv_manager: KVCacheManager, max_num_batched_tokens: int = 2048, max_num_seqs: int = 256):
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens: must be >= 1, got {max_num_batched_tokens}")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: must be >= 1, got {max_num_seqs}")
        self.kv = kv_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # Full-block hashes of the prompts waiting for their first admission: blocks that requests
        # queued ahead will have computed by the time a later one with the same prefix is admitted.
        self._pending_blocks: Counter[bytes] = Counter()

    # -- queue -----------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue a new request, with the prefix hit it can expect (cached blocks, or blocks a
        request queued ahead of it will compute) for :attr:`queued_prefill_tokens`."""
        request.status = RequestStatus.WAITING
        hit = self.kv.expected_hit_blocks(request, self._pending_blocks)
        request.num_expected_hit_tokens = hit * self.kv.block_size
        self._pending_blocks.update(request.block_hashes)
        self.waiting.append(request)

    def _unpend(self, request: Request) -> None:
        """The request leaves the waiting queue for the first time (admitted, or finished there)."""
        if request.num_cached_tokens < 0 and request.status is RequestStatus.WAITING:
            self._pending_blocks.subtract(request.block_hashes)
            for block_hash in request.block_hashes:
                if self._pending_blocks[block_hash] <= 0:
                    del self._pending_blocks[block_hash]

    def finish_request(self, request: Request) -> None:
        """Remove a request from the queues and free its blocks (finished or aborted)."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self.kv.free(request)
        elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self._unpend(request)
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    @property
    def queued_prefill_tokens(self) -> int:
        """Prompt tokens admitted or waiting that are still to be computed (for the router's cost
        model, which compares it with the tokens a new request would add): a waiting request
        counts what its expected prefix hit (:meth:`add_request`) leaves, as the router counts
        a request it sent, since queued tokens the cache will serve are no work."""
        return sum(r.num_tokens - max(r.num_computed_tokens, r.num_expected_hit_tokens) for r in self.waiting) + sum(
            max(0, r.num_tokens - r.num_computed_tokens - 1) for r in self.running
        )

    # -- the step ----------------------------------------------------------------------------------
    def _preempt_last(self) -> Request:
        victim = self.running.pop()
        self.kv.free(victim)
        victim.status = RequestStatus.PREEMPTED
        # Its full blocks stay cached when freed: what re-admission can expect to hit.
        victim.num_expected_hit_tokens = victim.num_computed_tokens // self.kv.block_size * self.kv.block_size
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        return victim

    def schedule(self) -> SchedulerOutput:
        """Pick this step's batch and reserve its KV slots; advances ``num_computed_tokens``."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n <= 0:
                i += 1
                continue
            while self.kv.allocate_slots(req, n) is None:
                victim = self._preempt_last()
                out.preempted.append(victim)
                if victim is req:
                    break
            if req.status is RequestStatus.PREEMPTED:
                break
            out.scheduled.append(ScheduledRequest(req, req.num_computed_tokens, n, []))
            budget -= n
            i += 1

        if not out.preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self.waiting[0]
                computed = self.kv.get_computed_blocks(req)
                hit = computed.num_computed_tokens
                n = min(req.num_tokens - hit, budget)
                if self.kv.allocate_slots(req, n, hit, computed) is None:
                    break
                self._unpend(req)
                self.waiting.popleft()
                self.running.append(req)
                req.status = RequestStatus.RUNNING
                req.num_computed_tokens = hit
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = hit
                out.num_prefix_hit_tokens += hit
                out.scheduled.append(ScheduledRequest(req, hit, n, []))
                budget -= n

        for s in out.scheduled:
            s.block_ids = self.kv.get_block_ids(s.request.request_id)
            s.request.num_computed_tokens += s.num_scheduled_tokens
        return out
