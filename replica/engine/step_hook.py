"""The step hook's engine side: what runs where the engine runs, after every step and idle tick.

    engine thread / engine process main thread                       frontend (replica.frontend)
    ─────────────────────────────────────────                        ───────────────────────────
    take_step_sample: EngineSample (load sample) ──▶ StepReport ──▶ on_step_report: admissions,
      KV events + engine_load(sample) ─▶ EventPublisher.on_step        latest sample (GetLoad,
                                                                        admission control, metrics)

Three shapes of "what the engine did", each its own thing:

- ``replica.engine.engine.StepStats``: what the last step scheduled, in tokens (the engine's own
  per-step stats; tests and benchmarks read it, nothing crosses a boundary with it).
- ``replica.telemetry.EngineSample``: the load sample after a step (queues, KV usage, cumulative
  prefix-cache counters): what GetLoad, admission control and the metrics read.
- :class:`StepReport`: the message the frontend gets per step: the sample, when the step began,
  and (from the engine process) its publisher's counters.

The heartbeat's :class:`~kvroute.heartbeat.EngineLoad` is built from the sample in one place,
:func:`engine_load`. With the engine on a thread, ``ReplicaFrontend.on_step`` calls
:func:`take_step_sample`; in the engine process, :class:`ProcessStepHook` does (it owns that
process's publisher). May import ``kvroute``, ``replica.publisher`` and ``replica.telemetry``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from kvroute.heartbeat import EngineLoad
from replica.publisher import EventPublisher, PublisherStats
from replica.telemetry import EngineSample, sample_engine

log = logging.getLogger(__name__)

_NO_STATS = PublisherStats()


def engine_load(sample: EngineSample) -> EngineLoad:
    """The heartbeat's load part of a sample."""
    return EngineLoad(
        free_blocks=sample.free_blocks, running=sample.running, waiting=sample.waiting, usage=sample.kv_usage,
        queued_prefill_tokens=sample.queued_prefill_tokens, prefill_tokens_per_s=sample.prefill_tokens_per_s,
        decode_seconds_per_running=sample.decode_seconds_per_running,
    )


def take_step_sample(engine: Any, publisher: EventPublisher) -> EngineSample:
    """Read the load sample of an ``LLMEngine`` and hand the step's KV events to ``publisher`` (a
    ``NullEventPublisher`` drops them: nobody else empties the pool's list). Engine thread only;
    never raises a publisher error into the step loop."""
    sample = sample_engine(engine)
    events = engine.take_kv_events()
    try:
        publisher.on_step(events, engine_load(sample), engine.kv.cached_event_hashes)
    except Exception:  # a publisher bug must not kill the step loop
        log.exception("KV event publisher failed in on_step")
    return sample


@dataclass(frozen=True)
class StepReport:
    """What the frontend learns from one engine step or idle tick.

    ``step_start_ns`` (``time.time_ns``) is when the step began (about when the previous hook
    returned): the admission time of what it admitted. ``publisher``: the engine process's
    publisher counters (with the engine on a thread the frontend's publisher is read directly,
    and this stays zero).
    """

    sample: EngineSample
    step_start_ns: int
    publisher: PublisherStats = _NO_STATS


class ProcessStepHook:
    """The step hook in the engine process (``ProcessLLMEngine``'s ``step_hook_factory`` makes it):
    :func:`take_step_sample`, and a :class:`StepReport` for the server when the sample or the
    publisher's counters changed since the last one (idle ticks mostly change nothing). Owns the
    publisher of that process (started by the factory): ``close`` stops it."""

    def __init__(self, publisher: EventPublisher) -> None:
        self.publisher = publisher
        self._prev_hook_ns = time.time_ns()
        self._last: tuple[EngineSample, PublisherStats] | None = None

    def __call__(self, engine: Any) -> StepReport | None:
        now = time.time_ns()
        prev, self._prev_hook_ns = self._prev_hook_ns, now
        sample = take_step_sample(engine, self.publisher)
        stats = self.publisher.stats()
        if (sample, stats) == self._last:
            return None
        self._last = (sample, stats)
        return StepReport(sample, prev, stats)

    def request_snapshot(self) -> None:
        """The publisher's ``request_snapshot`` (the server sends it with ``ProcessLLMEngine.run_in_hook``)."""
        self.publisher.request_snapshot()

    def start_draining(self) -> None:
        """The publisher's ``start_draining`` (sent like ``request_snapshot``)."""
        self.publisher.start_draining()

    def serving_alive(self) -> None:
        """The publisher's ``serving_alive``: the server process is alive (sent like ``request_snapshot``)."""
        self.publisher.serving_alive()

    def close(self) -> None:
        self.publisher.close()


__all__ = ["ProcessStepHook", "StepReport", "engine_load", "take_step_sample"]
