"""The replica heartbeat: one record, written by replicas and read by routers (DESIGN.md §4).

    replica publisher ──Heartbeat.to_redis()──▶ HSET kvroute:{ns:k}:replica:{id} (+ PEXPIRE 3 intervals)
    router consumer  ◀──Heartbeat.from_redis()── HGETALL

Every field is a string in Redis. A heartbeat carries the replica's position in its event stream
(``epoch``, ``last_seq`` written), its identity (the served model and the hash triple the router
checks before routing to it, DESIGN.md §2), the model limits the router validates requests
against (``vocab_size``, ``max_model_len``; DESIGN.md §5) and its load after the latest engine step
(:class:`EngineLoad`), and whether it is draining (a graceful stop has begun: it takes no new call;
written at once when the drain starts). Expiry of the key means the replica is gone. A field an older replica does
not write reads as its default: 0 for the limits, meaning "not said".
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvroute.engine_info import EngineInfo


@dataclass(frozen=True)
class EngineLoad:
    """A replica's load after one engine step: the part of the heartbeat that changes every step.

    ``free_blocks`` counts KV blocks not in use (cached-but-free ones included); ``usage`` is
    ``1 - free / (num_blocks - 1)`` in [0, 1]; ``queued_prefill_tokens`` is the prompt work the
    scheduler still has queued, in tokens. The replica's measured speed over its recent steps
    (``replica.engine.step_rates``; 0 = not measured yet): ``prefill_tokens_per_s``, prompt
    tokens computed per second of prefill, and ``decode_seconds_per_running``, the step time one
    running sequence adds; the router's default cost uses them (router.scoring).
    """

    free_blocks: int = 0
    running: int = 0
    waiting: int = 0
    usage: float = 0.0
    queued_prefill_tokens: int = 0
    prefill_tokens_per_s: float = 0.0
    decode_seconds_per_running: float = 0.0


ENGINE_KVROUTE = "kvroute"
ENGINE_VLLM = "vllm"
ENGINES = (ENGINE_KVROUTE, ENGINE_VLLM)
"""The replica kinds a router serves (a heartbeat's ``engine``)."""

_INT_FIELDS = ("epoch", "last_seq", "block_size", "num_blocks", "vocab_size", "max_model_len", "max_waiting")
_LOAD_INT_FIELDS = ("free_blocks", "running", "waiting", "queued_prefill_tokens")
_LOAD_FLOAT_FIELDS = ("usage", "prefill_tokens_per_s", "decode_seconds_per_running")


@dataclass(frozen=True)
class Heartbeat:
    """One replica heartbeat, as the Redis hash ``kvroute:{ns:k}:replica:{replica_id}`` holds it.

    Attributes:
        replica_id, address: who the replica is and where it serves gRPC (``host:port``).
        epoch: the publisher's epoch (``time_ns`` at replica start); ``last_seq``: the last batch
            seq written to the event stream in that epoch.
        model, block_size, hash_algorithm, hash_seed_digest, num_blocks, attn_backend,
            attn_backend_reason: the replica's identity (:class:`kvroute.engine_info.EngineInfo`'s
            heartbeat part; the last two say which attention backend runs and why).
        vocab_size, max_model_len: the engine's limits (token ids in ``[0, vocab_size)``; prompt +
            output tokens per request); 0 when the heartbeat does not say (a replica older than
            these fields): the router then assumes the model folder's.
        load: the latest :class:`EngineLoad`.
        max_waiting: the replica's waiting-queue bound (requests past it are refused with
            RESOURCE_EXHAUSTED); 0 when the replica does not say. An endpoint picker sheds a request
            (429) when every candidate's ``load.waiting`` has reached it.
        engine: what serves at ``address``: ``"kvroute"`` (this project's replica, gRPC
            ReplicaService) or ``"vllm"`` (a stock vLLM server's OpenAI HTTP API, its heartbeat
            written by ``kvroute bridge``; DESIGN.md §3.4). A heartbeat without it is kvroute's.
        ts: the replica's wall clock when written (Unix seconds).
        draining: the replica is stopping gracefully: it refuses new calls while the ones in flight
            finish, so it is not routable. Written ``"1"`` / ``"0"``; absent reads as ``False``.
        invalid: ``"name=value"`` for each field :meth:`from_redis` could not parse as a finite
            number (those read as 0); a heartbeat with any is not routable. Never written.
    """

    replica_id: str
    address: str = ""
    epoch: int = 0
    last_seq: int = 0
    model: str = ""
    block_size: int = 0
    hash_algorithm: str = ""
    hash_seed_digest: str = ""
    num_blocks: int = 0
    vocab_size: int = 0
    max_model_len: int = 0
    max_waiting: int = 0
    attn_backend: str = ""
    attn_backend_reason: str = ""
    load: EngineLoad = field(default_factory=EngineLoad)
    engine: str = ENGINE_KVROUTE
    ts: float = 0.0
    draining: bool = False
    invalid: tuple[str, ...] = ()

    @classmethod
    def of(
        cls, info: EngineInfo, *, replica_id: str, address: str, epoch: int, last_seq: int, load: EngineLoad,
        ts: float, max_waiting: int = 0, engine: str = ENGINE_KVROUTE,
    ) -> Heartbeat:
        """The heartbeat of an engine described by ``info``."""
        return cls(
            replica_id=replica_id, address=address, epoch=epoch, last_seq=last_seq, model=info.model,
            block_size=info.block_size, hash_algorithm=info.hash_algorithm,
            hash_seed_digest=info.hash_seed_digest, num_blocks=info.num_blocks, vocab_size=info.vocab_size,
            max_model_len=info.max_model_len, attn_backend=info.attn_backend,
            attn_backend_reason=info.attn_backend_reason, load=load, ts=ts, max_waiting=max_waiting, engine=engine,
        )

    @property
    def hash_identity(self) -> tuple[str, str, int]:
        """(hash algorithm, seed digest, block_size): what must equal the router's own."""
        return self.hash_algorithm, self.hash_seed_digest, self.block_size

    def to_redis(self) -> dict[str, str]:
        """The hash fields to HSET (every one of :data:`FIELDS`, as strings)."""
        load = self.load
        return {
            "replica_id": self.replica_id,
            "address": self.address,
            "epoch": str(self.epoch),
            "last_seq": str(self.last_seq),
            "model": self.model,
            "block_size": str(self.block_size),
            "hash_algorithm": self.hash_algorithm,
            "hash_seed_digest": self.hash_seed_digest,
            "num_blocks": str(self.num_blocks),
            "vocab_size": str(self.vocab_size),
            "max_model_len": str(self.max_model_len),
            "max_waiting": str(self.max_waiting),
            "attn_backend": self.attn_backend,
            "attn_backend_reason": self.attn_backend_reason,
            "free_blocks": str(load.free_blocks),
            "running": str(load.running),
            "waiting": str(load.waiting),
            "usage": repr(float(load.usage)),
            "queued_prefill_tokens": str(load.queued_prefill_tokens),
            "prefill_tokens_per_s": repr(float(load.prefill_tokens_per_s)),
            "decode_seconds_per_running": repr(float(load.decode_seconds_per_running)),
            "engine": self.engine,
            "ts": repr(float(self.ts)),
            "draining": "1" if self.draining else "0",
        }

    @classmethod
    def from_redis(cls, fields: Mapping[str, str] | Mapping[bytes, bytes]) -> Heartbeat:
        """Parse an HGETALL result (str or bytes keys and values). Heartbeats are untrusted input:
        a field that does not parse reads as 0 and is listed in ``invalid``; a missing one reads as
        its default.

        Raises:
            ValueError: ``replica_id`` is missing or empty (the record names nobody).
        """
        text = {
            (k.decode(errors="replace") if isinstance(k, bytes) else k): (
                v.decode(errors="replace") if isinstance(v, bytes) else str(v)
            )
            for k, v in fields.items()
        }
        replica_id = text.get("replica_id", "")
        if not replica_id:
            raise ValueError("heartbeat: missing replica_id")
        bad: list[str] = []

        def number(name: str, kind: type[int] | type[float]) -> int | float:
            raw = text.get(name, "")
            try:
                value = kind(raw or 0)
            except ValueError:
                value = None
            if value is None or not math.isfinite(value):  # "nan" / "inf" parse as floats: refused too
                bad.append(f"{name}={raw!r}")
                return kind(0)
            return value

        ints = {name: int(number(name, int)) for name in _INT_FIELDS}
        load = EngineLoad(
            **{name: int(number(name, int)) for name in _LOAD_INT_FIELDS},
            **{name: float(number(name, float)) for name in _LOAD_FLOAT_FIELDS},
        )
        ts = float(number("ts", float))
        draining = text.get("draining", "0") or "0"
        if draining not in ("0", "1"):
            bad.append(f"draining={draining!r}")
        return cls(
            replica_id=replica_id, address=text.get("address", ""), model=text.get("model", ""),
            hash_algorithm=text.get("hash_algorithm", ""), hash_seed_digest=text.get("hash_seed_digest", ""),
            attn_backend=text.get("attn_backend", ""), attn_backend_reason=text.get("attn_backend_reason", ""),
            load=load, engine=text.get("engine") or ENGINE_KVROUTE, ts=ts, draining=draining == "1",
            invalid=tuple(bad), **ints,
        )


FIELDS: tuple[str, ...] = tuple(Heartbeat(replica_id="x").to_redis())
"""The names of a heartbeat hash's fields, in the order :meth:`Heartbeat.to_redis` writes them."""


__all__ = ["ENGINES", "ENGINE_KVROUTE", "ENGINE_VLLM", "FIELDS", "EngineLoad", "Heartbeat"]
