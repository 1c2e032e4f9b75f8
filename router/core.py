"""The routing decision: hash the prompt, look up the index, score the replicas, pick one.

No I/O: the proxy and ``RouterService.Score`` call ``decide``; the proxy then ``commit``s the
decision (speculative index entries + load accounting) right before dispatching.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

from kvroute.hashing import NO_KEYS, BlockHasher, BlockHashKeys
from router.index import BlockIndex
from router.load import LoadTracker, RouterShare, Ticket
from router.policies.base import Policy
from router.registry import ReplicaInfo, ReplicaRegistry
from router.scoring import CandidateTable, RequestShape, Scored
from router.speculative import SpeculativeCredit


@dataclass
class Decision:
    """A routing decision as data. ``picked`` is None when no replica is routable (``reason``)."""

    picked: ReplicaInfo | None
    scored: Sequence[Scored]  # every candidate's (router.scoring.ScoredTable: made when read)
    block_hashes: list[int]
    prompt_tokens: int
    block_size: int
    policy: str
    predicted_cached_tokens: int = 0
    reason: str = ""
    timings: dict[str, float] = field(default_factory=dict)  # seconds: hash, lookup, score, total
    speculative: SpeculativeCredit | None = None  # set by Router.commit: the credit Router.withdraw takes back

    def score_of(self, replica_id: str) -> Scored | None:
        return next((s for s in self.scored if s.candidate.replica_id == replica_id), None)


class Router:
    """Owns the decision path. ``policy`` can be switched at run time (``set_policy``).

    ``index_lock`` is the lock the event consumer holds while it writes the index (its own thread);
    lookups and speculative writes take it too. ``decision_lock`` is held by whoever decides and
    then commits (the proxy on the event loop, the endpoint picker on its pool's threads): a
    decision is made on the load of every pick before it, as one thread would.
    """

    def __init__(
        self,
        hasher: BlockHasher,
        index: BlockIndex,
        registry: ReplicaRegistry,
        load: LoadTracker,
        policy: Policy,
        index_lock: threading.Lock | None = None,
    ):
        self.hasher = hasher
        self.index = index
        self.index_lock = index_lock if index_lock is not None else contextlib.nullcontext()
        self.registry = registry
        self.load = load
        self.policy = policy
        self.decision_lock = threading.Lock()

    def set_policy(self, policy: Policy) -> None:
        self.policy = policy

    def decide(
        self, token_ids: Sequence[int], cache_salt: str | None = None, exclude: Collection[str] = ()
    ) -> Decision:
        """Score every routable replica (minus ``exclude``) for this prompt.

        Raises:
            ValueError: a token id is negative or not an integer.
        """
        t0 = time.perf_counter()
        keys = BlockHashKeys(cache_salt=cache_salt) if cache_salt else NO_KEYS
        hashes = self.hasher.event_ints(token_ids, keys)
        t1 = time.perf_counter()
        infos = self.registry.routable()
        if exclude:
            infos = [r for r in infos if r.replica_id not in exclude]
        with self.index_lock:
            matches = self.index.matches(hashes)  # a replica absent matched nothing
        t2 = time.perf_counter()
        in_flight, pending = self.load.all_totals()
        cands = CandidateTable(infos, matches, in_flight, pending)
        req = RequestShape(len(token_ids), self.hasher.block_size)
        pick, scored = self.policy.choose(cands, req)
        t3 = time.perf_counter()
        decision = Decision(
            picked=cands.info_of(pick) if pick else None,
            scored=scored,
            block_hashes=hashes,
            prompt_tokens=len(token_ids),
            block_size=self.hasher.block_size,
            policy=self.policy.name,
            predicted_cached_tokens=pick.cached_tokens(req) if pick else 0,
            reason="" if pick else self._no_replica_reason(exclude),
            timings={"hash": t1 - t0, "lookup": t2 - t1, "score": t3 - t2, "total": t3 - t0},
        )
        return decision

    def _no_replica_reason(self, exclude: Collection[str]) -> str:
        known = self.registry.all()
        if not known:
            return "no replica is known (none discovered or heartbeating)"
        why = "; ".join(f"{r.replica_id}: {r.reason or 'excluded' if r.replica_id in exclude else r.reason}" for r in known)
        return f"no replica is routable ({why})"

    def commit(self, decision: Decision) -> Ticket:
        """Account the picked replica's load and credit it speculatively with the prompt's blocks,
        held until the request's prefill is done (:meth:`prefill_done`): behind a long queue a
        fixed TTL would run out first, and the next turn of the conversation would not see its
        prefix there.

        A replica removed since ``decide`` (expired, or no longer routable) gets no credit: the
        consumer has dropped it from the index, and a speculative entry would bring it back for
        good (its bit and maps). The registry is read under ``index_lock`` because the consumer
        changes the registry before it drops the index entries under that lock.
        """
        assert decision.picked is not None
        rid = decision.picked.replica_id
        with self.index_lock:
            info = self.registry.get(rid)
            if info is not None and info.routable:
                decision.speculative = self.index.add_speculative(rid, decision.block_hashes, hold=True)
        uncached = max(decision.prompt_tokens - decision.predicted_cached_tokens, 1)
        ticket = self.load.begin(rid, uncached)
        ticket.speculative = decision.speculative
        return ticket

    def withdraw(self, decision: Decision) -> None:
        """Take back a committed decision's speculative entries: the replica refused the request
        or failed before its first token, so it will not store the blocks it was credited with.
        Only this request's hold goes: entries other requests hold stay. Call it before
        :meth:`finish` (a released credit gives back only the TTL it started)."""
        if decision.speculative is None:
            return
        with self.index_lock:
            self.index.remove_speculative(decision.speculative)
        decision.speculative = None

    def prefill_done(self, ticket: Ticket) -> None:
        """The request's first token arrived: its pending prefill leaves the load, and its
        speculative entries expire ``speculative_ttl`` from now (idempotent)."""
        if not ticket.prefill_done and ticket.speculative is not None:
            with self.index_lock:
                self.index.release_speculative(ticket.speculative)
        self.load.prefill_done(ticket)

    def finish(self, ticket: Ticket) -> None:
        """The request completed, failed or was cancelled (idempotent; releases what
        :meth:`prefill_done` would if the first token never came)."""
        self.prefill_done(ticket)
        self.load.finish(ticket)

    # -- several routers (router.load_sync moves these through Redis) ----------------------------
    def share(self) -> RouterShare:
        """What the other routers need of this one: its own in-flight load, and its speculative
        entries beyond the real ones (every router indexes the same KV events)."""
        load = self.load.local()
        with self.index_lock:
            speculative = self.index.own_speculative()
        return RouterShare(load, speculative)

    def merge(self, router_id: str, share: RouterShare | None) -> None:
        """Router ``router_id``'s share, as of its last publication, replaces what it shared before
        (None: it is gone). Its speculative entries count for the replicas routable here only: an
        entry for one this router has dropped would bring it back into the index (as in
        :meth:`commit`)."""
        self.load.set_remote(router_id, share.load if share is not None else None)
        with self.index_lock:
            entries = None
            if share is not None:
                entries = {rid: hashes for rid, hashes in share.speculative.items()
                           if (info := self.registry.get(rid)) is not None and info.routable}
            self.index.set_remote_speculative(router_id, entries)
