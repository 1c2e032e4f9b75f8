"""Speculative index entries (DESIGN.md §5): a routed request's blocks credited to its replica
before the replica's BlockStored events arrive. No I/O; the :class:`router.index.BlockIndex` owns
one and reads ``mask`` in its lookups.

    hash -> bitmask of credited replicas          mask   (ORed with the GPU masks in a lookup)
    (hash, bit) -> live holds                     holds  (requests still waiting for their prefill)
    (hash, bit) -> expiry of the latest TTL       until  (the clock's seconds)
    (until, bit, hashes), in expiry order         queue  (the clock only goes forward)

An entry (hash, bit) is in ``mask`` while a request holds it or its TTL has not run out. Holds are
counted per request (:class:`SpeculativeCredit`), so that requests sharing a prefix on one replica
do not end each other's credit: a withdrawal takes back one hold, and a release starts a TTL that
only matters once the last hold is gone. Holds are few at a time (requests before their first
token); an entry no request holds costs what it did before holds were counted: ``mask`` and
``until``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class SpeculativeCredit:
    """One request's credit: replica ``bit``, its ``hashes``, and ``until``: ``math.inf`` while
    held, else the expiry of the TTL it set (the clock's seconds). ``live`` turns false when it is
    withdrawn or its replica is forgotten: releasing or withdrawing it again does nothing."""

    bit: int
    hashes: Sequence[int]
    until: float
    live: bool = True


class SpeculativeEntries:
    """The speculative entries of every replica, by replica bit (see the module docstring).

    Args:
        ttl: seconds an entry lives after its credit (a TTL credit, or a hold's release).
        clock: monotonic clock, the index's.
    """

    def __init__(self, ttl: float, clock: Callable[[], float]):
        self.ttl = ttl
        self._clock = clock
        self.mask: dict[int, int] = {}
        self._holds: dict[tuple[int, int], int] = {}
        self._until: dict[tuple[int, int], float] = {}
        self._queue: deque[tuple[float, int, Sequence[int]]] = deque()
        self._held: set[SpeculativeCredit] = set()  # live credits still held

    def credit(self, bit: int, hashes: Sequence[int], hold: bool) -> SpeculativeCredit:
        """Credit replica ``bit`` with ``hashes``: one more hold of each, or a TTL from now."""
        mask = self.mask
        if not hold:
            for h in hashes:
                mask[h] = mask.get(h, 0) | bit
            return SpeculativeCredit(bit, hashes, self._start_ttl(bit, hashes))
        holds = self._holds
        for h in hashes:
            mask[h] = mask.get(h, 0) | bit
            key = (h, bit)
            holds[key] = holds.get(key, 0) + 1
        credit = SpeculativeCredit(bit, hashes, math.inf)
        self._held.add(credit)
        return credit

    def release(self, credit: SpeculativeCredit) -> None:
        """A held credit's request is prefilled: its holds go, and its entries live ``ttl`` from now
        (the other holds of an entry keep it until they go too). Else nothing."""
        if not credit.live or credit.until != math.inf:
            return
        self._held.discard(credit)
        holds, until, bit = self._holds, self._until, credit.bit
        ends = self._clock() + self.ttl
        for h in credit.hashes:
            key = (h, bit)
            n = holds[key] - 1
            if n:
                holds[key] = n
            else:
                del holds[key]
            until[key] = ends  # the clock only goes forward: the latest end
        self._queue.append((ends, bit, credit.hashes))
        credit.until = ends

    def withdraw(self, credit: SpeculativeCredit) -> None:
        """Take ``credit`` back (its request will not store the blocks). A held credit gives up its
        holds: an entry stays while another request holds it or a TTL runs. A TTL credit takes back
        its TTL from the entries no request credited since (the same expiry) and holds none of."""
        if not credit.live:
            return
        credit.live = False
        bit, until = credit.bit, self._until
        if credit.until == math.inf:
            self._held.discard(credit)
            holds, now = self._holds, self._clock()
            for h in credit.hashes:
                key = (h, bit)
                n = holds[key] - 1
                if n:
                    holds[key] = n
                    continue
                del holds[key]
                ends = until.get(key)
                if ends is None or ends <= now:  # no TTL left: the hold was all that kept it
                    if ends is not None:
                        del until[key]
                    self._drop(h, bit)
            return
        for h in credit.hashes:
            key = (h, bit)
            if until.get(key) == credit.until:
                del until[key]
                if key not in self._holds:
                    self._drop(h, bit)

    def expire(self) -> None:
        """Drop the entries whose TTL has run out and that no request holds."""
        now = self._clock()
        q, until, holds = self._queue, self._until, self._holds
        while q and q[0][0] <= now:
            _, bit, hashes = q.popleft()
            for h in hashes:
                key = (h, bit)
                ends = until.get(key)
                if ends is not None and ends <= now:
                    del until[key]
                    if key not in holds:
                        self._drop(h, bit)

    def forget(self, bit: int) -> None:
        """Drop every entry of replica ``bit`` and void its held credits (the bit is being freed)."""
        for key in [k for k in self._until if k[1] == bit]:
            del self._until[key]
        for key in [k for k in self._holds if k[1] == bit]:
            del self._holds[key]
        for credit in [c for c in self._held if c.bit == bit]:
            credit.live = False
            self._held.discard(credit)
        keep = ~bit
        mask = self.mask
        for h in [h for h, v in mask.items() if v & bit]:
            v = mask[h] & keep
            if v:
                mask[h] = v
            else:
                del mask[h]

    def _start_ttl(self, bit: int, hashes: Sequence[int]) -> float:
        ends = self._clock() + self.ttl
        until = self._until
        for h in hashes:
            until[(h, bit)] = ends
        self._queue.append((ends, bit, hashes))
        return ends

    def _drop(self, h: int, bit: int) -> None:
        """Clear ``bit`` from ``mask[h]`` (the entry's holds and TTL are gone already)."""
        mask = self.mask
        v = mask.get(h, 0) & ~bit
        if v:
            mask[h] = v
        else:
            mask.pop(h, None)
