"""The routing service: the one sequence of routing steps every front calls (DESIGN.md §5).

The gRPC proxy (router.proxy), the endpoint picker (router.picker) and the OpenAI HTTP front
(router.http_api) only speak their protocol; what a request goes through before it is sent
anywhere is here, once::

    checked_ids   tokenize + validate against the model limits (InvalidRequestError naming the field)
    route         leave out: the caller's exclusions, replicas without an address, replicas outside
                  the endpoint subset hint, replicas whose waiting queue is full (QueuesFullError
                  when that leaves nobody); then decide + commit as one step under
                  Router.decision_lock (NoReplicaError when nothing is routable)
    prefill_done  the first token came: the pending prefill leaves the load
    finish        completed / failed / cancelled (exactly once per route)
    withdraw      the replica refused or failed before its first token: its speculative entries go

No I/O: the fronts own their transports. Thread-safe: the proxy calls it on the event loop, the
picker from its pool's threads.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import grpc

from kvroute.prompt import InvalidRequestError, PromptTokenizer, UnknownModelError, check_model
from kvroute.sampling import sampling_params_from_proto, validate_request
from kvroute.v1 import generation_pb2 as gen_pb
from kvroute.v1 import router_pb2 as router_pb
from router.core import Decision, Router
from router.load import Ticket
from router.model_limits import UNBOUNDED
from router.policies.base import Policy
from router.policies.registry import POLICY_NAMES
from router.registry import ReplicaInfo
from router.telemetry import RouterMetrics

log = logging.getLogger(__name__)


class NoReplicaError(Exception):
    """No replica can take the request (the message says why): UNAVAILABLE.

    ``decision`` is the decision that found nobody (None when none was made), for the metrics.
    """

    def __init__(self, message: str, decision: Decision | None = None) -> None:
        super().__init__(message)
        self.decision = decision


class QueuesFullError(Exception):
    """Every candidate's waiting queue is at the bound it advertises: RESOURCE_EXHAUSTED (retry
    later), the status the replicas themselves answer with."""


def classify_error(exc: BaseException) -> tuple[grpc.StatusCode, str] | None:
    """The status of an exception that escaped a front's handler (None: a bug -> INTERNAL)."""
    if isinstance(exc, InvalidRequestError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, UnknownModelError):
        return grpc.StatusCode.NOT_FOUND, str(exc)
    if isinstance(exc, NoReplicaError):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, QueuesFullError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, grpc.aio.AioRpcError):  # the replica's status, unchanged
        return exc.code(), exc.details() or ""
    return None


@dataclass(frozen=True)
class Route:
    """A committed pick: ``decision.picked`` is set; ``ticket`` holds its load until ``finish``."""

    decision: Decision
    ticket: Ticket

    @property
    def replica(self) -> ReplicaInfo:
        assert self.decision.picked is not None
        return self.decision.picked


class RoutingService:
    """The routing steps over one :class:`router.core.Router` (the module docstring's table).

    Args:
        router: the decision path (index, registry, load, policy).
        tokenizer: the replicas' tokenizer (the model folder's).
        policy_factory: ``name -> Policy`` for :meth:`set_policy` (raises ValueError for unknown names).
        metrics: where the fronts record (None: nothing is recorded).
    """

    def __init__(
        self,
        router: Router,
        tokenizer: PromptTokenizer,
        *,
        policy_factory: Callable[[str], Policy],
        metrics: RouterMetrics | None = None,
    ) -> None:
        self._router = router
        self.tokenizer = tokenizer
        self.metrics = metrics
        self._policy_factory = policy_factory
        self._finished_at: dict[str, float] = {}  # replica id -> wall clock of its last finished request
        # The model folder's limits: what a replica whose heartbeat does not say is assumed to hold.
        self._folder_limits = (tokenizer.vocab_size, tokenizer.max_model_len or UNBOUNDED)

    # -- what the fronts read ----------------------------------------------------------------------
    @property
    def hasher(self):
        """The router's :class:`kvroute.hashing.BlockHasher` (block_size, algorithm, seed digest)."""
        return self._router.hasher

    def replicas(self) -> list[ReplicaInfo]:
        """Every replica the registry knows, routable or not."""
        return self._router.registry.all()

    def routable(self) -> list[ReplicaInfo]:
        """The replicas a request can be routed to now."""
        return self._router.registry.routable()

    def replica(self, replica_id: str) -> ReplicaInfo | None:
        """The registry's entry for ``replica_id`` (None: unknown or expired)."""
        return self._router.registry.get(replica_id)

    def model_limits(self) -> tuple[int, int]:
        """``(vocab_size, max_model_len)`` requests are validated against: the largest the routable
        replicas report in their heartbeats, the model folder's for one that does not say
        (router.model_limits; ``max_model_len`` is ``UNBOUNDED`` when nobody gives one)."""
        return self._router.registry.limits().resolve(self._folder_limits)

    def checked_ids(self, request: gen_pb.GenerateRequest) -> list[int]:
        """The prompt's token ids, the whole request validated as a replica would (given ids against
        the vocabulary, sampling values and length: against :meth:`model_limits`).

        Raises:
            UnknownModelError: ``model`` names another model than the router's.
            InvalidRequestError: the field at fault (before anything is routed).
        """
        check_model(request.model, self.tokenizer.model_name)
        vocab_size, max_model_len = self.model_limits()
        ids = self.tokenizer.token_ids(request, vocab_size)  # checks given ids against the vocabulary
        sampling = request.sampling if request.HasField("sampling") else None
        validate_request(ids, sampling_params_from_proto(sampling), vocab_size=vocab_size,
                         max_model_len=max_model_len, check_ids=False)
        return ids

    # -- the pick ----------------------------------------------------------------------------------
    def decide(self, token_ids: Sequence[int], cache_salt: str = "") -> Decision:
        """The decision for the prompt over every routable replica, committing nothing (Score's
        preview; ``picked`` is None when nobody is routable)."""
        return self._router.decide(token_ids, cache_salt or None)

    def route(self, token_ids: Sequence[int], cache_salt: str = "", *, exclude: Collection[str] = (),
              subset: Sequence[str] | None = None, engines: Collection[str] | None = None) -> Route:
        """Pick a replica for the prompt and commit the pick (speculative entries, in-flight load).

        Args:
            token_ids: the prompt, already checked (:meth:`checked_ids`); empty: any routable replica.
            cache_salt: the request's cache_salt ("" for none).
            exclude: replica ids not to pick (ones that already failed this request).
            subset: the gateway's endpoint subset hint, as ``host:port`` addresses (None: no hint).
            engines: the replica kinds the caller's protocol can reach at a replica's address
                (kvroute.heartbeat.ENGINES; None: every kind).

        Raises:
            NoReplicaError: nobody is routable (or none of the subset); the message says why.
            QueuesFullError: every candidate's waiting queue is full.
        """
        if subset is not None and not subset:
            raise NoReplicaError("the endpoint subset is empty")
        left_out = set(exclude)
        left_out.update(r.replica_id for r in self.replicas()
                        if not r.address or (subset is not None and r.address not in subset))
        if engines is not None:
            other = {r.replica_id for r in self.replicas() if r.engine not in engines}
            routable = {r.replica_id for r in self.routable()} - left_out
            if routable and routable <= other:
                kinds = ", ".join(sorted({r.engine for r in self.routable()}))
                raise NoReplicaError(f"no routable replica takes this call at its address: it needs a "
                                     f"{' or '.join(engines)} replica, the routable ones are {kinds}")
            left_out |= other
        full = self._full_queues(left_out)
        if full and len(full) == sum(1 for r in self.routable() if r.replica_id not in left_out):
            queues = ", ".join(f"{r.replica_id} {r.waiting}/{r.max_waiting}" for r in full)
            raise QueuesFullError(f"every replica's waiting queue is full ({queues}); retry later")
        left_out.update(r.replica_id for r in full)
        router = self._router
        with router.decision_lock:  # decide + commit as one step (the other fronts' threads pick too)
            decision = router.decide(token_ids, cache_salt or None, left_out)
            ticket = router.commit(decision) if decision.picked is not None else None
        if ticket is None:
            why = decision.reason if subset is None else f"no replica of the subset {','.join(subset)} is routable"
            raise NoReplicaError(why, decision)
        return Route(decision, ticket)

    def _full_queues(self, left_out: Collection[str]) -> list[ReplicaInfo]:
        """The candidates whose heartbeat shows their waiting queue at the bound they advertise
        (``max_waiting``; replicas that advertise none are never full). They would refuse the call
        with RESOURCE_EXHAUSTED, so they are left out. A heartbeat lags: one written before a
        request on that replica finished here no longer counts as full (the queue has moved). The
        replica still enforces its bound itself."""
        finished = self._finished_at
        return [r for r in self.routable() if r.replica_id not in left_out and 0 < r.max_waiting <= r.waiting
                and finished.get(r.replica_id, 0.0) <= r.written_at]

    def next_best(self, decision: Decision, n: int) -> list[str]:
        """The addresses of up to ``n`` other scored replicas, cheapest first (gateway fallbacks)."""
        if n <= 0:
            return []
        picked = decision.picked.replica_id if decision.picked is not None else ""
        ranked = sorted((s for s in decision.scored if s.candidate.replica_id != picked), key=lambda s: s.cost)
        addresses = [info.address for s in ranked if (info := self.replica(s.candidate.replica_id)) is not None]
        return addresses[:n]

    # -- after the pick ----------------------------------------------------------------------------
    def prefill_done(self, ticket: Ticket) -> None:
        """The request's first token arrived (or its replica's heartbeat covers it; idempotent)."""
        self._router.prefill_done(ticket)

    def finish(self, ticket: Ticket) -> None:
        """The request completed, failed or was cancelled (idempotent)."""
        if not ticket.finished:
            self._finished_at[ticket.replica_id] = time.time()
        self._router.finish(ticket)

    def withdraw(self, decision: Decision) -> None:
        """The replica refused or failed before its first token: take back the speculative entries
        (before :meth:`finish`)."""
        self._router.withdraw(decision)

    # -- RouterService -----------------------------------------------------------------------------
    def set_policy(self, name: str) -> str:
        """Switch the policy at run time; returns its name.

        Raises:
            InvalidRequestError: ``policy`` is not one of POLICY_NAMES.
        """
        if name not in POLICY_NAMES:
            raise InvalidRequestError("policy", f"unknown {name!r}; expected one of {', '.join(POLICY_NAMES)}")
        policy = self._policy_factory(name)
        with self._router.decision_lock:
            self._router.set_policy(policy)
        log.info("routing policy is now %s", policy.name)
        return policy.name

    def score(self, request: router_pb.ScoreRequest) -> router_pb.ScoreResponse:
        """The decision for ``request`` as data, without generating or committing anything.

        Raises:
            InvalidRequestError: a bad prompt field.
        """
        ids = self.tokenizer.token_ids(request, self.model_limits()[0])
        d = self.decide(ids, request.cache_salt)
        resp = router_pb.ScoreResponse(
            prompt_tokens=len(ids), num_blocks=len(d.block_hashes), policy=d.policy,
            picked_replica_id=d.picked.replica_id if d.picked is not None else "",
        )
        scored = {s.candidate.replica_id: s for s in d.scored}
        for info in sorted(self.replicas(), key=lambda i: i.replica_id):
            s = scored.get(info.replica_id)
            rs = resp.replicas.add(
                replica_id=info.replica_id, address=info.address, routable=s is not None,
                reason=info.reason if s is None else "", running=info.running, kv_usage=info.usage,
            )
            if s is None:
                in_flight, pending = self._router.load.totals(info.replica_id)
                rs.in_flight = in_flight
                rs.queued_prefill_tokens = max(info.queued_prefill_tokens, pending)
                if not rs.reason:
                    rs.reason = "not routable"
                continue
            c = s.candidate
            rs.gpu_matched_blocks = c.match.gpu
            rs.cpu_matched_blocks = c.match.cpu
            rs.speculative_matched_blocks = c.match.speculative
            rs.queued_prefill_tokens = c.queued_prefill_tokens
            rs.in_flight = c.in_flight
            rs.running = c.running
            rs.kv_usage = c.kv_usage
            rs.cost = s.cost
        return resp


__all__ = ["NoReplicaError", "QueuesFullError", "Route", "RoutingService", "classify_error"]
