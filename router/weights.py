"""The cost model's weights, declared once: the fields of :class:`ScoringWeights` are the router's
settings (``--prefill-work-weight``, ``KVROUTE_PREFILL_WORK_WEIGHT``, ...; ``RouterSettings``
inherits them) and ``kvroute simulate``'s flags of the same names (DESIGN.md §5).

A leaf: it imports only ``kvroute.settings``, so a flag parser can read it without loading the router.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvroute.settings import setting


@dataclass(frozen=True)
class ScoringWeights:
    """Knobs of the cost model in ``router.scoring``. ``prefill_tokens_per_s`` and
    ``decode_seconds_per_running`` None: the pool's measured ones (``router.scoring.pool_rate``).

    The defaults of ``prefill_work_weight`` and ``kv_footprint_weight`` were chosen on ``kvroute
    simulate`` and checked on ``make run`` and the peers' workload, one default for all
    (docs/results.md). ``kv_usage_weight`` is off by default: a fixed cost per unit of the last
    heartbeat's usage moves a short prompt off the replica holding its prefix when that replica
    was busy a moment ago (the footprint term does not).

    Raises:
        ValueError: a rate is not positive, a weight is negative, or ``cpu_match_weight`` is
            outside [0, 1] (the message names the field).
    """

    prefill_tokens_per_s: float | None = setting(
        None, "a replica's prefill rate, tokens/s, for every replica (default: the replicas' measured ones)"
    )
    decode_seconds_per_running: float | None = setting(
        None, "TTFT added per running sequence, seconds, for every replica (default: the replicas' measured ones)"
    )
    prefill_work_weight: float = setting(30.0, "weight of the prefill work a request adds to the cluster")
    backlog_work_weight: float = setting(1.0, "more weight on the prefill work per request waiting on the replica")
    cpu_match_weight: float = setting(0.5, "fraction of a block's prefill a CPU-tier hit saves (its copy-back costs the rest)")
    kv_footprint_weight: float = setting(
        2.0, "weight of the prompt's prefill seconds, charged times the replica's KV usage"
    )
    kv_usage_weight: float = setting(0.0, "seconds added at full KV usage")
    in_flight_weight: float = setting(0.0, "seconds added per request in flight from the routers")

    def __post_init__(self) -> None:
        if self.prefill_tokens_per_s is not None and not self.prefill_tokens_per_s > 0:
            raise ValueError(f"prefill_tokens_per_s: must be > 0, got {self.prefill_tokens_per_s}")
        if self.decode_seconds_per_running is not None and not self.decode_seconds_per_running >= 0:
            raise ValueError(f"decode_seconds_per_running: must be >= 0, got {self.decode_seconds_per_running}")
        if not self.backlog_work_weight >= 0:
            raise ValueError(f"backlog_work_weight: must be >= 0, got {self.backlog_work_weight}")
        if not self.kv_footprint_weight >= 0:
            raise ValueError(f"kv_footprint_weight: must be >= 0, got {self.kv_footprint_weight}")
        if not 0.0 <= self.cpu_match_weight <= 1.0:
            raise ValueError(f"cpu_match_weight: must be in [0, 1], got {self.cpu_match_weight}")

    def weights(self) -> ScoringWeights:
        """These weights alone (for a subclass such as ``RouterSettings``, a plain ``ScoringWeights``)."""
        return ScoringWeights(**{name: getattr(self, name) for name in WEIGHT_NAMES})


WEIGHT_NAMES: tuple[str, ...] = tuple(ScoringWeights.__dataclass_fields__)
"""The field names of :class:`ScoringWeights`, in declaration order."""

__all__ = ["WEIGHT_NAMES", "ScoringWeights"]
