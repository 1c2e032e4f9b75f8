"""The event-driven cluster loop in virtual time: arrivals, the real router(s), N simulated replicas.

    trace ──arrival──▶ router.core.Router.decide + commit (index, registry, load, policy: the real ones)
                              │ pick                         ▲ heartbeats every heartbeat_s (registry)
                              ▼                              │ KV events after event_delay_s (IndexFeed)
                        SimReplica k (real Scheduler + KVCacheManager, TimingModel) ── first token /
                                                                                       finish ──▶ LoadTracker

Events are processed in time order (a heap; arrivals merge in from the trace). KV events of a step
leave the replica at the step's end and reach the index ``event_delay_s`` later; they are applied
lazily, right before the next decision, which is the only reader, through the live consumer's
apply path: each step's events become one ``KVEventBatch`` (``kvroute.events.encode_batch``, the
replica publisher's encoding, without the token ids, which the router never reads) handed to
``router.consumer_feed.IndexFeed.entry`` as the next seq of the replica's stream (epoch 1), so the
ordering rules, the protobuf decode and the index calls are the router's own. The index's clock (speculative
entries' TTL) is the virtual clock. Requests go to the replica at the instant they are routed (no
network time). The decision time reported is the wall time of ``decide`` + ``commit``.

Several routers (``routers``): request i goes to router i mod M, each a whole live router (its own
index, registry, load tracker and policy) fed every replica's events and heartbeats at the same
instants. They share what they route as the live ones do through Redis (``router.load_sync``):
router j publishes its ``Router.share()`` to a stand-in for Redis and merges every other router's
latest publication, every ``load_sync_s`` virtual seconds at its own phase (router j at
``(k + (j + 1) / M) * load_sync_s``), so each sees the others' in-flight load and speculative
entries only as of their last publication before its last sync; ``load_sync_s`` 0 syncs them all
before every decision. Their policies draw ties from one generator (common random numbers: each
router's draws are still independent uniform ones, and a comparison with one router is not blurred
by tie-breaks drawn in another order), so with ``load_sync_s`` 0, M routers of a policy whose only
state is the router's (kvroute, least_loaded) decide exactly as one does.
"""

from __future__ import annotations

import dataclasses
import heapq
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvroute.events import BlockStored, KVCacheEvent, encode_batch
from kvroute.hashing import BlockHasher
from kvroute.heartbeat import Heartbeat
from kvroute_tools.simulate.replica import SimReplica, SimRequest
from kvroute_tools.simulate.timing import TimingModel
from kvroute_tools.simulate.workload import output_tokens, prompt_of
from kvroute_tools.trace import TraceRequest
from router.consumer_feed import IndexFeed
from router.core import Router
from router.index import BlockIndex
from router.load import LoadTracker, RouterShare
from router.policies.base import Policy
from router.policies.registry import make_policy
from router.registry import ReplicaRegistry
from router.scoring import ScoringWeights


@dataclass(frozen=True)
class SimConfig:
    """One simulated cluster. Sizes in blocks of ``block_size`` tokens, times in seconds.

    Raises:
        ValueError: a size below its minimum, or block_size not dividing tokens_per_block.
    """

    replicas: int = 4
    routers: int = 1
    load_sync_s: float = 0.2  # with routers > 1: seconds between a router's load syncs (the live default)
    num_blocks: int = 4096  # per replica, block 0 included
    block_size: int = 512
    tokens_per_block: int = 512
    cpu_blocks: int = 0
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    timing: TimingModel = field(default_factory=TimingModel)
    time_scale: float = 1.0
    output_scale: float = 1.0
    event_delay_s: float = 0.01
    heartbeat_s: float = 1.0
    speculative_ttl: float = 2.0
    weights: ScoringWeights = field(default_factory=ScoringWeights)
    seed: int = 0

    def __post_init__(self) -> None:
        for name, low in (("replicas", 1), ("routers", 1), ("num_blocks", 2), ("block_size", 1), ("tokens_per_block", 1),
                          ("cpu_blocks", 0), ("max_num_batched_tokens", 1), ("max_num_seqs", 1)):
            if getattr(self, name) < low:
                raise ValueError(f"{name}: must be >= {low}, got {getattr(self, name)}")
        if self.tokens_per_block % self.block_size:
            raise ValueError(f"block_size {self.block_size} must divide tokens_per_block {self.tokens_per_block}")
        for name in ("time_scale", "output_scale", "heartbeat_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        for name in ("event_delay_s", "speculative_ttl", "load_sync_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")

    def replica_ids(self) -> list[str]:
        """Zero-padded, so that id order is index order (round robin deals 0, 1, 2, ...)."""
        width = len(str(self.replicas - 1))
        return [f"r{k:0{width}d}" for k in range(self.replicas)]


@dataclass
class PolicyRun:
    """What one policy's replay measured. Times in virtual seconds except ``decide_s`` / ``wall_s``."""

    policy: str
    replicas: int
    routers: int
    requests: list[SimRequest]
    routed: list[int]
    preemptions: int
    queue_samples: list[int]
    decide_s: list[float]
    wall_s: float
    end_s: float
    busy_s: list[float]


class SimError(RuntimeError):
    """A request cannot be served by the simulated cluster (the message says which flag to raise)."""


_STEP, _HEARTBEAT, _SYNC = 0, 1, 2


@dataclass
class _SimRouter:
    """One router of the simulated cluster: the live router's parts, fed like the live consumer."""

    name: str
    router: Router
    policy: Policy
    registry: ReplicaRegistry
    feed: IndexFeed


def simulate(trace: Sequence[TraceRequest], cfg: SimConfig, policy_name: str,
             progress: Callable[[int], None] | None = None, policy: Policy | None = None) -> PolicyRun:
    """Replay ``trace`` (in order, timestamps scaled by ``cfg.time_scale``) through ``cfg.replicas``
    replicas routed by ``cfg.routers`` routers of policy ``policy_name``
    (``router.policies.registry.make_policy``; or ``policy`` itself, one router only).
    ``progress(n)`` is called with the number of requests routed so far, now and then.

    Raises:
        SimError: a request needs more blocks than a replica has.
        ValueError: an unknown policy name, or ``policy`` given for several routers.
    """
    wall0 = time.perf_counter()
    hasher = BlockHasher(block_size=cfg.block_size)
    now = 0.0
    if policy is not None and cfg.routers > 1:
        raise ValueError("policy: one Policy object is one router's; pass a policy name for several routers")
    rng = random.Random(cfg.seed)  # the routers' one tie-breaking generator (module docstring)
    policies = [policy] if policy is not None else [make_policy(policy_name, cfg.weights, rng=rng)
                                                    for _ in range(cfg.routers)]
    first = policies[0]
    kv_fed = first.index_from_kv_events
    ttl = cfg.speculative_ttl if first.speculative_ttl is None else first.speculative_ttl
    routers = []
    for j, pol in enumerate(policies):
        index = BlockIndex(ttl, clock=lambda: now)
        registry = ReplicaRegistry(hasher.identity, "redis")
        routers.append(_SimRouter(f"router-{j}", Router(hasher, index, registry, LoadTracker(), pol), pol,
                                  registry, IndexFeed(index, registry, threading.Lock())))
    published: dict[str, RouterShare] = {}  # what each router last wrote (the stand-in for Redis)
    ids = cfg.replica_ids()
    reps = [SimReplica(rid, cfg.num_blocks, hasher, cfg.timing, max_num_batched_tokens=cfg.max_num_batched_tokens,
                       max_num_seqs=cfg.max_num_seqs, cpu_num_blocks=cfg.cpu_blocks) for rid in ids]
    for pol in policies:
        pol.set_block_capacity(cfg.num_blocks - 1)
    pending: list[deque] = [deque() for _ in reps]  # (due_s, encoded batch) per replica
    batches = [0] * len(reps)  # the last seq of each replica's stream
    heap: list = []
    seq = 0

    def push(t: float, kind: int, k: int, obj: object) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(heap, (t, seq, kind, k, obj))

    def heartbeat(k: int) -> None:
        rep = reps[k]
        hb = Heartbeat(replica_id=rep.replica_id, address=rep.replica_id, epoch=1, last_seq=rep.steps,
                       model="sim", block_size=cfg.block_size, hash_algorithm=hasher.algorithm,
                       hash_seed_digest=hasher.seed_digest, num_blocks=cfg.num_blocks, load=rep.load(), ts=now)
        for r in routers:
            r.registry.update_from_heartbeat(hb, now)

    def publish(j: int) -> None:
        published[routers[j].name] = routers[j].router.share()

    def merge(j: int) -> None:
        me = routers[j]
        for other in routers:
            if other is not me and other.name in published:
                me.router.merge(other.name, published[other.name])

    for k in range(len(reps)):
        heartbeat(k)
        push(cfg.heartbeat_s * (k + 1) / len(reps), _HEARTBEAT, k, None)
    if cfg.routers > 1 and cfg.load_sync_s > 0:
        for j in range(cfg.routers):
            push(cfg.load_sync_s * (j + 1) / cfg.routers, _SYNC, j, None)
    results: list[SimRequest] = []
    decide_s: list[float] = []
    queue: list[int] = []
    n, i = len(trace), 0
    t_first = trace[0].timestamp_ms if trace else 0.0
    max_tokens = (cfg.num_blocks - 1) * cfg.block_size
    every = max(1, n // 200)
    while True:
        t_arr = (trace[i].timestamp_ms - t_first) / 1000 * cfg.time_scale if i < n else float("inf")
        if heap and heap[0][0] <= t_arr:
            now, _, kind, k, obj = heapq.heappop(heap)
            if kind == _SYNC:  # router k's RedisLoadSync.sync_once: write its share, read the others'
                publish(k)
                merge(k)
                if i < n or any(not r.idle for r in reps):
                    push(now + cfg.load_sync_s, _SYNC, k, None)
                continue
            rep = reps[k]
            if kind == _HEARTBEAT:
                heartbeat(k)
                queue.append(len(rep.scheduler.waiting))
                if i < n or any(not r.idle for r in reps):
                    push(now + cfg.heartbeat_s, _HEARTBEAT, k, None)
                continue
            if rep.step is not obj or obj.end_s != now:
                continue  # a decode window that was cut: its new end is queued
            first_tokens, finished, events = rep.finish()
            for sr in first_tokens:
                routers[sr.router].router.prefill_done(sr.ticket)
            for sr in finished:
                routers[sr.router].router.finish(sr.ticket)
                sr.prompt = []
            if events and kv_fed:
                pending[k].append((now + cfg.event_delay_s, step_batch(events, now)))
            st = rep.start(now)
            if st is not None:
                push(st.end_s, _STEP, k, st)
            continue
        if i >= n:
            break
        now = t_arr
        req = trace[i]
        sr = SimRequest(i, now, prompt_of(req, cfg.tokens_per_block), output_tokens(req, cfg.output_scale))
        if len(sr.prompt) + sr.output_tokens > max_tokens:
            raise SimError(f"request {i} needs {len(sr.prompt) + sr.output_tokens} tokens, a replica holds"
                           f" {max_tokens}; raise --num-blocks (or --cache-fraction)")
        for k, q in enumerate(pending):
            while q and q[0][0] <= now:
                batches[k] += 1
                batch = q.popleft()[1]
                for r in routers:
                    r.feed.entry(ids[k], 1, batches[k], batch, history=False)
        if cfg.routers > 1 and cfg.load_sync_s == 0:  # every router sees every other's state as of now
            for j in range(cfg.routers):
                publish(j)
            for j in range(cfg.routers):
                merge(j)
        sr.router = i % cfg.routers
        me = routers[sr.router]
        t0 = time.perf_counter()
        if me.policy.observes_prompt:
            me.policy.observe_prompt(hasher.event_ints(sr.prompt))
        decision = me.router.decide(sr.prompt)
        sr.ticket = me.router.commit(decision)
        decide_s.append(time.perf_counter() - t0)
        k = ids.index(decision.picked.replica_id)
        rep = reps[k]
        rep.add(sr, now)
        st = rep.start(now) if rep.idle else rep.cut(now)
        if st is not None:
            push(st.end_s, _STEP, k, st)
        results.append(sr)
        i += 1
        if progress is not None and (i % every == 0 or i == n):
            progress(i)
    return PolicyRun(
        policy=policy_name, replicas=cfg.replicas, routers=cfg.routers, requests=results, routed=[r.routed for r in reps],
        preemptions=sum(r.scheduler.num_preemptions for r in reps), queue_samples=queue, decide_s=decide_s,
        wall_s=time.perf_counter() - wall0, end_s=now, busy_s=[r.busy_s for r in reps],
    )


def step_batch(events: Sequence[KVCacheEvent], ts: float) -> bytes:
    """One step's events as the replica publisher encodes them, the token ids left out (the router
    never reads them; encoding them would be most of the simulation's time)."""
    return encode_batch([dataclasses.replace(e, token_ids=()) if isinstance(e, BlockStored) else e for e in events], ts)


__all__ = ["PolicyRun", "SimConfig", "SimError", "simulate", "step_batch"]
