"""The server process's stand-in for the event publisher that runs in the engine process
(replica.engine.core_proc starts it there through ``make_process_step_hook``)."""

from __future__ import annotations

from collections.abc import Sequence

from kvroute.events import KVCacheEvent
from kvroute.heartbeat import EngineLoad
from replica.engine.core_client import ProcessLLMEngine
from replica.engine.step_hook import ProcessStepHook
from replica.publisher.base import EventPublisher, PublisherStats, SnapshotFn


class RemotePublisher(EventPublisher):
    """The server process's view of the publisher in the engine process: its counters as of the
    last step report (:meth:`update`, on the engine client's reader thread), ``request_snapshot``,
    ``start_draining`` and ``serving_alive`` forwarded to it. ``stats().last_seq`` may trail the real one by the
    steps still in the pipe, which keeps RequestSnapshot's promise: the snapshot is valid at the
    returned seq or later."""

    def __init__(self, engine: ProcessLLMEngine) -> None:
        self._engine = engine
        self._stats = PublisherStats()

    def update(self, stats: PublisherStats) -> None:
        self._stats = stats

    def stats(self) -> PublisherStats:
        return self._stats

    def request_snapshot(self) -> None:
        self._engine.run_in_hook(ProcessStepHook.request_snapshot)

    def start_draining(self) -> None:
        self._engine.run_in_hook(ProcessStepHook.start_draining)

    def serving_alive(self) -> None:
        self._engine.run_in_hook(ProcessStepHook.serving_alive)

    def start(self) -> None:
        """Nothing to do here: the engine process starts the publisher (``make_process_step_hook``)."""

    def close(self, timeout: float = 2.0) -> None:
        """Nothing to do here: the engine process closes the publisher when it stops."""

    def on_step(self, events: Sequence[KVCacheEvent], load: EngineLoad, snapshot_fn: SnapshotFn) -> None:
        """Never called in this process: the engine's steps run in the engine process."""


__all__ = ["RemotePublisher"]
