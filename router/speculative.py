"""Speculative index entries (DESIGN.md §5): a routed request's blocks credited to its replica
before the replica's BlockStored events arrive. No I/O; the :class:`router.index.BlockIndex` owns
one and reads ``mask`` in its lookups.

    hash -> bitmask of credited replicas          mask   (ORed with the GPU masks in a lookup)
    bit -> {hash: live holds}                     holds  (requests still waiting for their prefill)
    bit -> {hash: end of the latest TTL}          until  (the clock's seconds)
    (until, bit, hashes), in expiry order         queue  (the clock only goes forward)
    bit -> {hash: routers crediting it}           remote (other routers' entries, ``set_remote``)

An entry (hash, bit) is in ``mask`` while a request holds it, its TTL has not run out, or another
router's latest publication credits it (``router.load_sync``: each router sees the others' entries
as of their last sync, and a router's publication replaces its previous one). Holds are
counted per request (:class:`SpeculativeCredit`), so that requests sharing a prefix on one replica
do not end each other's credit: a withdrawal takes back one hold, and a release starts a TTL that
only matters once the last hold is gone. Holds are few at a time (requests before their first
token); an entry no request holds costs ``mask`` and ``until`` only. Keyed by bit, then hash
(not by a (hash, bit) tuple): no tuple per entry, and forgetting a replica drops two dicts.
``bench/speculative.py`` measures the memory per entry and the cost of a hold against real entries.
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
        self._holds: dict[int, dict[int, int]] = {}  # bit -> {hash: live holds}
        self._until: dict[int, dict[int, float]] = {}  # bit -> {hash: the latest TTL's end}
        self._queue: deque[tuple[float, int, Sequence[int]]] = deque()
        self._held: set[SpeculativeCredit] = set()  # live credits still held
        self._remote: dict[int, dict[int, int]] = {}  # bit -> {hash: routers crediting it}
        self._by_router: dict[str, dict[int, Sequence[int]]] = {}  # router -> {bit: hashes}, as last set

    def credit(self, bit: int, hashes: Sequence[int], hold: bool) -> SpeculativeCredit:
        """Credit replica ``bit`` with ``hashes``: one more hold of each, or a TTL from now."""
        mask = self.mask
        if not hold:
            for h in hashes:
                mask[h] = mask.get(h, 0) | bit
            return SpeculativeCredit(bit, hashes, self._start_ttl(bit, hashes))
        holds = self._holds.get(bit)
        if holds is None:
            holds = self._holds[bit] = {}
        for h in hashes:
            mask[h] = mask.get(h, 0) | bit
            holds[h] = holds.get(h, 0) + 1
        credit = SpeculativeCredit(bit, hashes, math.inf)
        self._held.add(credit)
        return credit

    def release(self, credit: SpeculativeCredit) -> None:
        """A held credit's request is prefilled: its holds go, and its entries live ``ttl`` from now
        (the other holds of an entry keep it until they go too). Else nothing."""
        if not credit.live or credit.until != math.inf:
            return
        self._held.discard(credit)
        holds = self._holds[credit.bit]
        for h in credit.hashes:
            _unhold(holds, h)
        credit.until = self._start_ttl(credit.bit, credit.hashes)  # the clock only goes forward: the latest end

    def withdraw(self, credit: SpeculativeCredit) -> None:
        """Take ``credit`` back (its request will not store the blocks). A held credit gives up its
        holds: an entry stays while another request holds it or a TTL runs. A TTL credit takes back
        its TTL from the entries no request credited since (the same expiry) and holds none of."""
        if not credit.live:
            return
        credit.live = False
        bit = credit.bit
        until = self._until.get(bit, {})
        holds = self._holds.get(bit, {})
        if credit.until == math.inf:
            self._held.discard(credit)
            now = self._clock()
            for h in credit.hashes:
                if not _unhold(holds, h):
                    continue
                ends = until.get(h)
                if ends is None or ends <= now:  # no TTL left: the hold was all that kept it
                    if ends is not None:
                        del until[h]
                    self._drop(h, bit)
            return
        for h in credit.hashes:
            if until.get(h) == credit.until:
                del until[h]
                if h not in holds:
                    self._drop(h, bit)

    def expire(self) -> None:
        """Drop the entries whose TTL has run out and that no request holds."""
        q = self._queue
        if not q:
            return
        now = self._clock()
        while q and q[0][0] <= now:
            _, bit, hashes = q.popleft()
            until = self._until.get(bit)
            if until is None:  # forgotten since
                continue
            holds = self._holds.get(bit, {})
            for h in hashes:
                ends = until.get(h)
                if ends is not None and ends <= now:
                    del until[h]
                    if h not in holds:
                        self._drop(h, bit)

    def own(self) -> dict[int, list[int]]:
        """``{bit: hashes}`` of this router's own live entries (held or in their TTL; not the other
        routers'), after dropping the expired."""
        self.expire()
        out: dict[int, list[int]] = {}
        for bit in self._holds.keys() | self._until.keys():
            hashes = self._holds.get(bit, {}).keys() | self._until.get(bit, {}).keys()
            if hashes:
                out[bit] = list(hashes)
        return out

    def set_remote(self, router: str, entries: dict[int, Sequence[int]]) -> None:
        """Router ``router``'s entries, ``{bit: hashes}``, replace what it credited before (empty:
        it credits nothing now). Its entries no longer credited leave ``mask`` unless this router or
        another still credits them."""
        old = self._by_router.pop(router, {})
        if entries:
            self._by_router[router] = dict(entries)
        for bit, hashes in entries.items():
            counts = self._remote.setdefault(bit, {})
            mask = self.mask
            for h in hashes:
                counts[h] = counts.get(h, 0) + 1
                mask[h] = mask.get(h, 0) | bit
        for bit, hashes in old.items():
            counts = self._remote.get(bit)
            if counts is None:  # forgotten since
                continue
            for h in hashes:
                n = counts.get(h, 0) - 1
                if n > 0:
                    counts[h] = n
                    continue
                counts.pop(h, None)
                if h not in self._holds.get(bit, ()) and h not in self._until.get(bit, ()):
                    self._drop(h, bit)
            if not counts:
                del self._remote[bit]

    def forget(self, bit: int) -> None:
        """Drop every entry of replica ``bit`` (other routers' too) and void its held credits (the
        bit is being freed)."""
        self._until.pop(bit, None)
        self._holds.pop(bit, None)
        self._remote.pop(bit, None)
        for entries in self._by_router.values():
            entries.pop(bit, None)
        for credit in [c for c in self._held if c.bit == bit]:
            credit.live = False
            self._held.discard(credit)
        for h in [h for h, v in self.mask.items() if v & bit]:
            self._drop(h, bit)

    def _start_ttl(self, bit: int, hashes: Sequence[int]) -> float:
        """Set the TTL of (``hashes``, ``bit``) to end ``ttl`` from now; returns the end."""
        ends = self._clock() + self.ttl
        until = self._until.get(bit)
        if until is None:
            until = self._until[bit] = {}
        until.update(dict.fromkeys(hashes, ends))
        self._queue.append((ends, bit, hashes))
        return ends

    def _drop(self, h: int, bit: int) -> None:
        """Clear ``bit`` from ``mask[h]`` (the entry's holds and TTL are gone already), unless
        another router credits the entry."""
        if h in self._remote.get(bit, ()):
            return
        mask = self.mask
        v = mask.get(h, 0) & ~bit
        if v:
            mask[h] = v
        else:
            mask.pop(h, None)


def _unhold(holds: dict[int, int], h: int) -> bool:
    """One hold of ``h`` fewer; True when it was the last (the entry is then held no more)."""
    n = holds[h] - 1
    if n:
        holds[h] = n
        return False
    del holds[h]
    return True
