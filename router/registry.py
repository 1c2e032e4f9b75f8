"""The router's view of its replicas: identity, load and routability (DESIGN.md §2, §5). No I/O.

    consumer ── update_from_heartbeat(Heartbeat, now) / expire(id) ──▶ ┌──────────────────────────┐
    discovery ── set_discovered({"host:port", ...}) ────────────────▶ │ replica_id -> ReplicaInfo │
    core      ◀── routable() / get() / all() / limits() ────────────── └──────────────────────────┘
                                     on_removed(replica_id) ──▶ consumer (drops index entries)

Contract:
- A replica is **routable** iff it is discovered, heartbeating (its heartbeat key has not
  expired: ``expire`` removes it from the registry), hash-compatible (same hash algorithm, seed
  digest and block_size as the router), serving the router's model (the model folder's name,
  which requests name: a replica heartbeating another model would answer for it with another
  model's cache, ``"model 'b' != router's 'a'"``) and not draining (its heartbeat says a graceful
  stop has begun: it refuses new calls). Otherwise ``reason`` says why, e.g.
  ``"block_size 32 != router's 16"``; an incompatible replica is logged once at ERROR (a silent 0%
  hit rate is the failure this guards against) and counted in ``num_incompatible``.
- Discovery: with mode ``"redis"`` every heartbeating replica is discovered; with ``"static"`` or
  ``"kubernetes"`` a replica is discovered when the address in its heartbeat is in the last set
  given to ``set_discovered`` (empty until the first call).
- An id whose heartbeat address changes is logged at WARNING and counted in ``address_changes``
  (a restart elsewhere changes it once; two replicas sharing an id flip it back and forth).
- ``on_removed(replica_id)`` listeners run whenever a replica stops being routable or is expired,
  so the index never keeps entries of a replica that gets no traffic. They run on the thread that
  caused the change, outside the registry's lock.
- ``limits()``: the model limits the routable replicas' heartbeats report
  (:class:`router.model_limits.ReportedLimits`), rebuilt with the routable set, so that validating a
  request reads one object instead of scanning the replicas.
- Thread-safe. ``ReplicaInfo`` values are never mutated once published (an update replaces the
  object), so a reader on another thread always sees one consistent heartbeat.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvroute.heartbeat import ENGINE_KVROUTE, ENGINES, Heartbeat
from router.model_limits import ReportedLimits

log = logging.getLogger(__name__)

DISCOVERY_MODES = ("static", "redis", "kubernetes")


@dataclass(frozen=True)
class ReplicaInfo:
    """One replica as of its last :class:`kvroute.heartbeat.Heartbeat` (its fields, the load flattened)
    and the router's verdict on it; ``heartbeat_at``: the router's monotonic seconds when it read
    the heartbeat, ``written_at``: the replica's wall clock when it wrote it (Unix seconds);
    ``vocab_size`` / ``max_model_len``: the engine's limits, 0 when the heartbeat does not say;
    ``engine``: what serves at ``address`` (kvroute.heartbeat.ENGINES); ``draining``: the replica
    is stopping gracefully (never routable)."""

    replica_id: str
    address: str = ""
    epoch: int = 0
    last_seq: int = 0
    model: str = ""
    hash_algorithm: str = ""
    hash_seed_digest: str = ""
    block_size: int = 0
    num_blocks: int = 0
    vocab_size: int = 0  # 0: not said (a replica older than the field)
    max_model_len: int = 0
    free_blocks: int = 0
    running: int = 0
    waiting: int = 0
    max_waiting: int = 0  # the replica's waiting-queue bound (0: not said)
    usage: float = 0.0
    queued_prefill_tokens: int = 0
    prefill_tokens_per_s: float = 0.0  # measured by the replica; 0 = not yet
    decode_seconds_per_running: float = 0.0
    heartbeat_at: float = 0.0
    written_at: float = 0.0
    discovered: bool = False
    routable: bool = False
    reason: str = ""  # why it is not routable ("" when it is)
    hash_compatible: bool = False
    engine: str = ENGINE_KVROUTE
    draining: bool = False


class ReplicaRegistry:
    """Every heartbeating replica, with its discovery state and whether it may get traffic.

    Owns ``replica_id -> ReplicaInfo`` and the current discovered address set. Invariant: each
    info's ``discovered`` / ``routable`` / ``reason`` agree with that set, the router's identity and
    the info's own heartbeat.

    Args:
        expected_identity: the router's ``BlockHasher.identity``: (algorithm, seed_digest, block_size).
        discovery_mode: ``"static"``, ``"redis"`` or ``"kubernetes"``.
        model: the model requests are routed for (the router's model folder's name); a replica whose
            heartbeat names another is not routable. ``""`` accepts any (and so does a heartbeat
            that names none).

    Raises:
        ValueError: an unknown discovery mode.
    """

    def __init__(self, expected_identity: tuple[str, str, int], discovery_mode: str = "redis", model: str = ""):
        if discovery_mode not in DISCOVERY_MODES:
            raise ValueError(f"discovery: unknown mode {discovery_mode!r}; expected one of {DISCOVERY_MODES}")
        algorithm, seed_digest, block_size = expected_identity
        self.expected_identity = (str(algorithm), str(seed_digest), int(block_size))
        self.discovery_mode = discovery_mode
        self.model = model
        self._lock = threading.Lock()
        self._replicas: dict[str, ReplicaInfo] = {}
        self._addresses: frozenset[str] = frozenset()
        self._listeners: list[Callable[[str], None]] = []
        self._incompatible: dict[str, str] = {}  # replica_id -> why its hash triple is refused
        self._logged: dict[str, str] = {}  # replica_id -> the incompatibility last logged at ERROR
        self._routable: tuple[ReplicaInfo, ...] = ()
        self._limits = ReportedLimits()
        self.address_changes = 0  # heartbeats whose address differs from the id's previous one (a metric)

    # -- listeners -------------------------------------------------------------------------------
    def add_listener(self, on_removed: Callable[[str], None]) -> None:
        """Call ``on_removed(replica_id)`` whenever a replica is expired or stops being routable."""
        with self._lock:
            self._listeners.append(on_removed)

    def remove_listener(self, on_removed: Callable[[str], None]) -> None:
        with self._lock:
            if on_removed in self._listeners:
                self._listeners.remove(on_removed)

    def _notify(self, removed: Iterable[str]) -> None:
        for replica_id in removed:
            for cb in list(self._listeners):
                try:
                    cb(replica_id)
                except Exception:  # noqa: BLE001 - one broken listener must not starve the others
                    log.exception("registry: on_removed listener failed for %s", replica_id)

    # -- updates ------------------------------------------------------------------------------------
    def update_from_heartbeat(self, heartbeat: Heartbeat, now: float) -> ReplicaInfo:
        """Record one heartbeat (as :meth:`kvroute.heartbeat.Heartbeat.from_redis` read it); ``now``
        in the router's monotonic seconds. A heartbeat with fields that did not parse
        (``heartbeat.invalid``) is recorded but not routable ("bad heartbeat fields: ...").

        Raises:
            ValueError: the heartbeat has no ``replica_id``.
        """
        replica_id = heartbeat.replica_id
        if not replica_id:
            raise ValueError("heartbeat: missing replica_id")
        load = heartbeat.load
        info = ReplicaInfo(
            replica_id=replica_id, address=heartbeat.address, epoch=heartbeat.epoch, last_seq=heartbeat.last_seq,
            model=heartbeat.model, hash_algorithm=heartbeat.hash_algorithm,
            hash_seed_digest=heartbeat.hash_seed_digest, block_size=heartbeat.block_size,
            num_blocks=heartbeat.num_blocks, vocab_size=heartbeat.vocab_size, max_model_len=heartbeat.max_model_len,
            free_blocks=load.free_blocks, running=load.running,
            waiting=load.waiting, max_waiting=heartbeat.max_waiting, usage=load.usage,
            queued_prefill_tokens=load.queued_prefill_tokens,
            prefill_tokens_per_s=load.prefill_tokens_per_s, decode_seconds_per_running=load.decode_seconds_per_running,
            heartbeat_at=now, written_at=heartbeat.ts, engine=heartbeat.engine, draining=heartbeat.draining,
        )
        with self._lock:
            old = self._replicas.get(replica_id)
            incompatible = self._incompatibility(info, heartbeat.invalid)
            if incompatible:
                self._incompatible[replica_id] = incompatible
            else:
                self._incompatible.pop(replica_id, None)
            info = self._judge(info)
            self._replicas[replica_id] = info
            self._rebuild_routable()
            removed = [replica_id] if old is not None and old.routable and not info.routable else []
            to_log = self._take_log(replica_id, incompatible)
            flipped = old is not None and old.address != info.address
            if flipped:
                self.address_changes += 1
        if to_log:
            log.error("replica %s (%s) gets no traffic: %s", replica_id, info.address, to_log)
        if flipped:
            assert old is not None
            log.warning(
                "replica %s: address changed from %s (epoch %d) to %s (epoch %d); if this repeats, two"
                " replicas heartbeat under one id in this namespace (two clusters on one Redis namespace?)",
                replica_id, old.address, old.epoch, info.address, info.epoch,
            )
        self._notify(removed)
        return info

    def expire(self, replica_id: str) -> None:
        """The replica's heartbeat expired: forget it (listeners run if it was known)."""
        with self._lock:
            info = self._replicas.pop(replica_id, None)
            if info is None:
                return
            self._incompatible.pop(replica_id, None)
            self._logged.pop(replica_id, None)
            self._rebuild_routable()
        log.info("replica %s (%s): heartbeat expired", replica_id, info.address)
        self._notify([replica_id])

    def set_discovered(self, addresses: Iterable[str]) -> None:
        """The discovered ``"host:port"`` set (static / kubernetes discovery; ignored by "redis")."""
        addresses = frozenset(addresses)
        with self._lock:
            self._addresses = addresses
            removed = []
            for replica_id, old in list(self._replicas.items()):
                new = self._judge(old)
                if new != old:
                    self._replicas[replica_id] = new
                    if old.routable and not new.routable:
                        removed.append(replica_id)
            self._rebuild_routable()
        self._notify(removed)

    def _judge(self, info: ReplicaInfo) -> ReplicaInfo:
        """``info`` with discovered / routable / reason / hash_compatible set (caller holds the lock)."""
        discovered = self.discovery_mode == "redis" or info.address in self._addresses
        incompatible = self._incompatible.get(info.replica_id, "")
        reasons = [incompatible] if incompatible else []
        if not discovered:
            reasons.append(f"address {info.address or '(none)'} not discovered ({self.discovery_mode} discovery)")
        if info.draining:
            reasons.append("draining (shutting down: takes no new calls)")
        return dataclasses.replace(
            info,
            discovered=discovered,
            hash_compatible=not incompatible,
            routable=discovered and not incompatible and not info.draining,
            reason="; ".join(reasons),
        )

    def _incompatibility(self, info: ReplicaInfo, bad_fields: tuple[str, ...]) -> str:
        """Why ``info``'s heartbeat cannot be routed to by this router ("" when it can)."""
        reasons = []
        if bad_fields:
            reasons.append(f"bad heartbeat fields: {', '.join(bad_fields)}")
        algorithm, seed_digest, block_size = self.expected_identity
        if info.hash_algorithm != algorithm:
            reasons.append(f"hash_algorithm {info.hash_algorithm or '(none)'} != router's {algorithm}")
        if info.hash_seed_digest != seed_digest:
            reasons.append(f"hash_seed_digest {info.hash_seed_digest or '(none)'} != router's {seed_digest}")
        if info.block_size != block_size:
            reasons.append(f"block_size {info.block_size} != router's {block_size}")
        if self.model and info.model and info.model != self.model:
            reasons.append(f"model {info.model!r} != router's {self.model!r}")
        if info.engine not in ENGINES:
            reasons.append(f"engine {info.engine!r} is not one this router serves ({', '.join(ENGINES)})")
        return "; ".join(reasons)

    def _take_log(self, replica_id: str, reason: str) -> str:
        """``reason`` if it should be logged at ERROR now (once per replica and reason), else ""."""
        if not reason or self._logged.get(replica_id) == reason:
            return ""
        self._logged[replica_id] = reason
        return reason

    def _rebuild_routable(self) -> None:
        self._routable = tuple(i for i in self._replicas.values() if i.routable)
        self._limits = ReportedLimits.of((i.vocab_size, i.max_model_len) for i in self._routable)

    # -- reads --------------------------------------------------------------------------------------
    def routable(self) -> list[ReplicaInfo]:
        """The replicas that may get traffic now."""
        return list(self._routable)

    def limits(self) -> ReportedLimits:
        """The model limits the routable replicas report (router.model_limits has the rule)."""
        return self._limits

    def get(self, replica_id: str) -> ReplicaInfo | None:
        return self._replicas.get(replica_id)

    def all(self) -> list[ReplicaInfo]:
        """Every heartbeating replica, routable or not."""
        with self._lock:
            return list(self._replicas.values())

    @property
    def num_incompatible(self) -> int:
        """Heartbeating replicas this router cannot route to: another hash triple or model, a bad
        heartbeat, an unknown engine (a metric)."""
        with self._lock:
            return len(self._incompatible)


__all__ = ["DISCOVERY_MODES", "ReplicaInfo", "ReplicaRegistry"]
