"""The order of vLLM's KV event batches: what the bridge does with batch ``seq`` (a pure state machine).

vLLM numbers batches 0, 1, 2, ... from every server start, on one PUB stream (live) and, on request,
from its replay buffer (the last ``buffer_steps`` batches). The rules:

- **in order**: live ``seq == next``: apply it.
- **gap**: live ``seq > next``: hold it and ask the replay socket for every batch from ``next``
  (one replay at a time; held batches past ``max_held`` are dropped, a later replay brings them).
- **duplicate**: a live ``seq < next`` above the last live seq (a replay already gave it): drop.
- **restart**: a live ``seq`` at or below the last live seq: the PUB stream only moves forward, so
  the server restarted. A **new epoch**: everything known before is void (the bridge starts a new
  kvroute epoch: drop what the router knows of this replica); the batch is applied at once when it
  is seq 0, else held and a replay from 0 asked for.
- **filled**: a replay that reaches back to ``next`` applies the missing batches, then the held ones
  that follow; a hole left after them asks for another replay.
- **overrun**: a replay whose first batch is past ``next`` (vLLM's buffer no longer holds it), or a
  replay that failed: the missing batches are lost. A **new epoch** from what can be read: the
  replayed (and held) batches from the first one on. Blocks cached before them are then never
  announced: the router under-counts, it never sees a block that is not there.

At the start nothing is known: the first live batch is in order only if it is seq 0; otherwise the
bridge replays from 0 (an overrun if vLLM has run longer than its buffer). Either way the first
applied batch opens a new epoch.

A restart whose new seqs pass the old ones before the bridge sees one is invisible here: the
running bridge also watches the server's identity (its start time) and calls :meth:`restarted`.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")

MAX_HELD = 10000
"""Live batches held while a replay is outstanding (vLLM's default replay buffer is 10,000 steps)."""


class SeqOutcome(enum.Enum):
    """What became of one live batch or one replay."""

    IN_ORDER = "in_order"
    DUPLICATE = "duplicate"
    GAP = "gap"
    RESTART = "restart"
    FILLED = "filled"
    OVERRUN = "overrun"


@dataclass(frozen=True, slots=True)
class SeqDecision(Generic[T]):
    """What the bridge must do, in this order: if ``new_epoch``, forget everything (``Rekeyer.reset``,
    a new kvroute epoch); translate and publish ``apply`` (batches in seq order); if ``replay_from``
    is set, send a replay request from that seq (:func:`replica.bridge.vllm_events.replay_request`)."""

    outcome: SeqOutcome
    new_epoch: bool = False
    apply: tuple[T, ...] = ()
    replay_from: int | None = None


class VllmSequencer(Generic[T]):
    """Where one vLLM server's batch stream has been applied up to.

    ``T`` is whatever the bridge applies (a decoded ``VllmBatch``); this class only holds and returns
    them. Invariant: batches ``first .. next - 1`` of the current epoch were handed out exactly once,
    in order; held batches are all past ``next``; ``replay_pending`` is the seq of the one replay
    asked for and not answered yet (None when none is).

    Args:
        max_held: live batches held at most while a replay is outstanding.
    """

    def __init__(self, *, max_held: int = MAX_HELD):
        self.max_held = max_held
        self.epochs = 0  # new epochs opened so far (the first applied batch opens the first)
        self.held_dropped = 0
        self._reset()

    def _reset(self) -> None:
        self.next = 0
        self.last_live = -1
        self.replay_pending: int | None = None
        self._held: dict[int, T] = {}
        self._fresh = True  # nothing applied since the last new epoch was decided: the next apply opens one

    @property
    def num_held(self) -> int:
        return len(self._held)

    # -- live batches --------------------------------------------------------------------------------
    def live(self, seq: int, batch: T) -> SeqDecision[T]:
        """Live batch ``seq`` (from the PUB socket) carrying ``batch``."""
        if seq < 0:
            raise ValueError(f"seq: must be >= 0, got {seq}")
        if seq <= self.last_live:
            self._reset()
            self._open_now()
            self.last_live = seq
            if seq == 0:
                self.next = 1
                return SeqDecision(SeqOutcome.RESTART, True, (batch,))
            self._held[seq] = batch
            return SeqDecision(SeqOutcome.RESTART, True, replay_from=self._ask(0))
        self.last_live = seq
        if seq < self.next:
            return SeqDecision(SeqOutcome.DUPLICATE)
        if seq == self.next and not self._held:
            self.next += 1
            return SeqDecision(SeqOutcome.IN_ORDER, self._open(), (batch,))
        if len(self._held) < self.max_held:
            self._held[seq] = batch
        else:
            self.held_dropped += 1
        return SeqDecision(SeqOutcome.GAP, replay_from=self._ask(self.next))

    # -- replays -------------------------------------------------------------------------------------
    def begin_replay(self) -> int | None:
        """Ask for the history before any live batch (at the bridge's start, or to resync): the seq to
        replay from, or None when a replay is already outstanding."""
        return self._ask(self.next)

    def replayed(self, batches: Sequence[tuple[int, T]]) -> SeqDecision[T]:
        """The whole answer to the outstanding replay: ``(seq, batch)`` pairs in the order received,
        up to (not including) the end marker."""
        self.replay_pending = None
        for seq, batch in batches:
            if seq >= self.next:
                self._held.setdefault(seq, batch)
        first = min(self._held, default=None)
        if first is None:  # nothing missing that the bridge knows of
            return SeqDecision(SeqOutcome.FILLED)
        if first == self.next:
            return self._drain(SeqOutcome.FILLED, new_epoch=self._open())
        # Neither the replay nor the held batches have batch next: vLLM's buffer no longer holds it.
        self._open_now()
        self.next = first
        return self._drain(SeqOutcome.OVERRUN, new_epoch=True)

    def replay_failed(self) -> SeqDecision[T]:
        """The outstanding replay got no answer (the bridge gave up on it): an overrun from the first
        held batch, or FILLED with nothing to apply when none is held."""
        return self.replayed(())

    def restarted(self) -> SeqDecision[T]:
        """The server restarted (the bridge saw its identity change): a new epoch, waiting for seq 0."""
        self._reset()
        self._open_now()
        return SeqDecision(SeqOutcome.RESTART, True)

    # -- helpers -------------------------------------------------------------------------------------
    def _ask(self, seq: int) -> int | None:
        if self.replay_pending is not None:
            return None
        self.replay_pending = seq
        return seq

    def _open(self) -> bool:
        """True once after each reset: the first batch applied starts the epoch."""
        if not self._fresh:
            return False
        self._open_now()
        return True

    def _open_now(self) -> None:
        """A new epoch is decided now (the decision returned says ``new_epoch``)."""
        self.epochs += 1
        self._fresh = False

    def _drain(self, outcome: SeqOutcome, new_epoch: bool) -> SeqDecision[T]:
        """Hand out the held batches that follow ``next``; ask for a replay if a hole remains."""
        out = []
        while (batch := self._held.pop(self.next, None)) is not None:
            out.append(batch)
            self.next += 1
        replay_from = self._ask(self.next) if self._held else None
        return SeqDecision(outcome, new_epoch, tuple(out), replay_from)


__all__ = ["MAX_HELD", "SeqDecision", "SeqOutcome", "VllmSequencer"]
