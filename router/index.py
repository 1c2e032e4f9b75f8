"""The router's block index: which replica holds which block, per medium (DESIGN.md §5). No I/O.

    hash -> bitmask of replicas holding >= 1 copy        (one dict per medium, for lookups)
    (replica, medium) -> {hash: copies}                  (reference counts, for removals)

Replicas get a bit each. A lookup walks the request's hash chain from block 0 and ANDs the masks,
so the per-block cost does not grow with the number of replicas; the first block at which a
replica's bit drops out is its matched length. Duplicates exist on replicas (the same hash cached
in two blocks), so a BlockRemoved of one copy only clears the bit when the last copy goes.

Speculative entries (``router/speculative.py``) credit a replica with a request's blocks right
after routing it, held until its prefill is done and for a short TTL after, so that a burst of
requests sharing a new prefix lands on one replica before its BlockStored events arrive. They count
as GPU matches in lookups and are reported separately. They live apart from the real entries: no
speculative operation drops a real entry, and BlockRemoved / AllBlocksCleared leave them be (only
forgetting the replica drops them).

Other routers' speculative entries (``set_remote_speculative``, from the load sync) join the same
mask and count in lookups as this router's own do: every router indexes the same KV events, so
what one router's index needs from another is only the entries the events have not brought yet
(``own_speculative``).
"""

from __future__ import annotations

import time
from bisect import bisect_right
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate, islice, repeat
from operator import and_, neg, or_

from kvroute.events import CPU, GPU, MEDIA
from router.speculative import SpeculativeCredit, SpeculativeEntries

try:
    from router import _index
except ImportError:  # built without a C compiler: the Python loops below
    _index = None


@dataclass(slots=True)
class Match:
    """A replica's matched prefix for one request, in blocks: ``gpu`` leading blocks on the GPU,
    then ``cpu`` more on its CPU tier; ``speculative`` of the ``gpu`` ones are speculative."""

    gpu: int = 0
    cpu: int = 0
    speculative: int = 0


class BlockIndex:
    """Exact index of cached blocks per (replica, medium), with speculative entries.

    Args:
        speculative_ttl: seconds a speculative entry lives (0 disables them).
        clock: monotonic clock (injectable for tests).
    """

    def __init__(self, speculative_ttl: float = 2.0, clock: Callable[[], float] = time.monotonic):
        self._bits: dict[str, int] = {}
        self._free_bits: list[int] = []
        self._next_bit = 0
        self._masks: dict[str, dict[int, int]] = {m: {} for m in MEDIA}
        self._counts: dict[tuple[str, str], dict[int, int]] = {}
        self._spec = SpeculativeEntries(speculative_ttl, clock)

    @property
    def speculative_ttl(self) -> float:
        return self._spec.ttl

    # -- replicas ----------------------------------------------------------------------------------
    def _bit(self, replica: str) -> int:
        bit = self._bits.get(replica)
        if bit is None:
            if self._free_bits:
                bit = self._free_bits.pop()
            else:
                bit = 1 << self._next_bit
                self._next_bit += 1
            self._bits[replica] = bit
            for m in MEDIA:
                self._counts[(replica, m)] = {}
        return bit

    @property
    def replicas(self) -> list[str]:
        return list(self._bits)

    def num_entries(self, replica: str, medium: str | None = None) -> int:
        """Distinct hashes indexed for ``replica`` (one medium, or all)."""
        media = MEDIA if medium is None else (medium,)
        return sum(len(self._counts.get((replica, m), ())) for m in media)

    def clear_replica(self, replica: str, medium: str | None = None) -> None:
        """Drop what is known of ``replica`` (one medium, or all: AllBlocksCleared, new epoch)."""
        bit = self._bits.get(replica)
        if bit is None:
            return
        for m in MEDIA if medium is None else (medium,):
            counts = self._counts[(replica, m)]
            mask = self._masks[m]
            keep = ~bit
            for h in counts:
                v = mask[h] & keep
                if v:
                    mask[h] = v
                else:
                    del mask[h]
            counts.clear()

    def remove_replica(self, replica: str) -> None:
        """Forget ``replica`` entirely (heartbeat expired, discovery removed it); frees its bit."""
        bit = self._bits.get(replica)
        if bit is None:
            return
        self.clear_replica(replica)
        self._spec.forget(bit)  # its credits in flight come back void: the bit may be reused
        for m in MEDIA:
            del self._counts[(replica, m)]
        del self._bits[replica]
        self._free_bits.append(bit)

    # -- events ---------------------------------------------------------------------------------------
    def add(self, replica: str, hashes: Iterable[int], medium: str = GPU) -> None:
        """BlockStored: one more copy of each hash on (replica, medium)."""
        bit = self._bit(replica)
        counts = self._counts[(replica, medium)]
        mask = self._masks[medium]
        if _index is not None:
            _index.add_copies(counts, mask, hashes, bit)  # the loop below, in C (router/_index.c)
            return None
        get = counts.get
        for h in hashes:
            c = get(h, 0)
            counts[h] = c + 1
            if not c:
                mask[h] = mask.get(h, 0) | bit
        return None

    def remove(self, replica: str, hashes: Iterable[int], medium: str = GPU) -> int:
        """BlockRemoved: one copy fewer of each hash. Returns how many hashes were not indexed
        (a symptom of a missed event; the consumer resyncs on seq gaps anyway)."""
        bit = self._bits.get(replica)
        if bit is None:
            return sum(1 for _ in hashes)
        counts = self._counts[(replica, medium)]
        mask = self._masks[medium]
        if _index is not None:
            return _index.remove_copies(counts, mask, hashes, bit)  # the loop below, in C
        missing = 0
        for h in hashes:
            c = counts.get(h, 0)
            if c > 1:
                counts[h] = c - 1
            elif c == 1:
                del counts[h]
                v = mask[h] & ~bit
                if v:
                    mask[h] = v
                else:
                    del mask[h]
            else:
                missing += 1
        return missing

    def load(self, replica: str, media: dict[str, Iterable[int]]) -> None:
        """Replace everything known of ``replica`` with a snapshot (one entry per copy)."""
        self.clear_replica(replica)
        for medium, hashes in media.items():
            self.add(replica, hashes, medium)

    # -- speculative entries -----------------------------------------------------------------------
    def add_speculative(self, replica: str, hashes: Sequence[int], *, hold: bool = False) -> SpeculativeCredit | None:
        """Credit ``replica`` with ``hashes`` (a request just routed there) for ``speculative_ttl``;
        with ``hold``, until :meth:`release_speculative` and ``speculative_ttl`` after it (a request
        still waiting for its prefill there, however long the replica's queue). Each held credit is
        one hold of its entries: other requests' holds of the same entries are theirs.

        Returns:
            This request's credit, to pass to :meth:`release_speculative` and
            :meth:`remove_speculative`; None when nothing was credited (speculative entries off,
            or no hash).
        """
        if self.speculative_ttl <= 0 or not hashes:
            return None
        return self._spec.credit(self._bit(replica), hashes, hold)

    def release_speculative(self, credit: SpeculativeCredit | None) -> None:
        """``credit``'s request is prefilled (its BlockStored events are on their way): if it is
        still held, its holds go and its entries expire ``speculative_ttl`` from now, except those
        another request still holds (they stay until no hold is left, then until the latest
        release's TTL runs out). Idempotent; a withdrawn credit stays withdrawn."""
        if credit is not None:
            self._spec.release(credit)

    def remove_speculative(self, credit: SpeculativeCredit | None) -> None:
        """Withdraw ``credit`` (the request was refused, or failed before its first token: its
        blocks will never be stored). An entry another request holds, or credited again since
        (another expiry), stays; so does every real entry. Idempotent."""
        if credit is not None:
            self._spec.withdraw(credit)

    def expire_speculative(self) -> None:
        """Drop the speculative entries whose TTL has run out and that no request holds."""
        self._spec.expire()

    def own_speculative(self) -> dict[str, list[int]]:
        """``{replica: hashes}``: this router's own live speculative entries (credited here, not
        another router's) that are not real GPU entries too: what another router's index, fed the
        same KV events, cannot know yet. The expired are dropped first."""
        gpu = self._masks[GPU]
        names = {bit: r for r, bit in self._bits.items()}
        out = {}
        for bit, hashes in self._spec.own().items():
            mine = [h for h in hashes if not gpu.get(h, 0) & bit]
            if mine:
                out[names[bit]] = mine
        return out

    def set_remote_speculative(self, router: str, entries: dict[str, Sequence[int]] | None) -> None:
        """Router ``router``'s speculative entries (its :meth:`own_speculative`) replace the ones
        it gave before; None forgets that router. They count in lookups as this router's own, until
        then or until their replica is forgotten. Each replica named gets a bit: the caller names
        routable replicas only (:meth:`router.core.Router.merge`), as for its own credits."""
        self._spec.set_remote(router, {self._bit(r): hashes for r, hashes in (entries or {}).items() if hashes})

    # -- lookup -----------------------------------------------------------------------------------------
    def lookup(self, hashes: Sequence[int], replicas: Iterable[str] | None = None) -> dict[str, Match]:
        """Per replica, the leading run of ``hashes`` it holds (GPU or speculative), then the run
        after that on its CPU tier (mirrors the engine's get_computed_blocks).

        The walk is :func:`leading_runs`: one C pass (``router/_index.c``) when built and every
        mask fits 64 bits, else ``map(dict.get)`` + ``itertools.accumulate(and_)`` and a bisection
        per run length (:func:`_run_ends`) instead of a Python loop per block.

        Args:
            hashes: the request's block hash chain (event ints), block 0 first.
            replicas: the candidates (default: every indexed replica). Unknown ones match 0.

        Returns:
            ``{replica: Match}`` for every candidate.
        """
        self._spec.expire()
        names = list(self._bits) if replicas is None else list(replicas)
        out = {r: Match() for r in names}
        bits = {self._bits[r]: r for r in names if r in self._bits}
        if not bits or not hashes:
            return out
        alive = 0
        for b in bits:
            alive |= b
        n = len(hashes)
        hashes = hashes if type(hashes) is list else list(hashes)
        gpu, spec = self._masks[GPU], self._spec.mask
        gpu_end = leading_runs(hashes, (gpu, spec) if spec else (gpu,), 0, alive)
        if spec:
            # A replica's real run ends at its first block held only speculatively.
            real_end = leading_runs(hashes, (gpu,), 0, alive)
            for b, r in bits.items():
                out[r].speculative = max(gpu_end[b] - real_end[b], 0)
        for b, r in bits.items():
            out[r].gpu = gpu_end[b]
        cpu = self._masks[CPU]
        if cpu:
            starts: dict[int, int] = {}  # run start -> replicas starting there
            for b, end in gpu_end.items():
                if end < n:
                    starts[end] = starts.get(end, 0) | b
            for start, mask in starts.items():
                for b, end in leading_runs(hashes, (cpu,), start, mask).items():
                    out[bits[b]].cpu = end - start
        return out

    def has(self, replica: str, block_hash: int, medium: str = GPU) -> bool:
        return self._counts.get((replica, medium), {}).get(block_hash, 0) > 0

    def cached_set(self, replica: str, medium: str = GPU) -> dict[int, int]:
        """A copy of ``{hash: copies}`` for (replica, medium) (tests, debugging)."""
        return dict(self._counts.get((replica, medium), {}))


def leading_runs(hashes: list[int], dicts: tuple[dict[int, int], ...], start: int, mask: int) -> dict[int, int]:
    """For each bit of ``mask``: where its run of consecutive blocks from ``start`` ends, a block
    being held when the OR of ``d.get(h, 0)`` over ``dicts`` carries the bit (:func:`_run_ends`).

    Uses the compiled walk (``router/_index.c``: one pass, stops when no bit is left) when it was
    built and the masks fit in 64 bits; else the Python walk. Same answers (tests check both).
    """
    if _index is not None and mask < 1 << 64:
        try:
            return _index.run_ends(hashes, dicts, start, mask)
        except OverflowError:  # a replica bit past 64 in some entry
            pass
    tail = hashes[start:]  # the blocks before ``start`` are never looked at
    held = list(map(dicts[0].get, tail, repeat(0)))
    for d in dicts[1:]:
        held = list(map(or_, held, map(d.get, tail, repeat(0))))
    return {b: start + end for b, end in _run_ends(held, 0, mask).items()}


def _run_ends(held: Sequence[int], start: int, mask: int) -> dict[int, int]:
    """For each bit of ``mask``: the index one past the last of the consecutive entries of
    ``held`` from ``start`` on that carry the bit (``start`` itself when ``held[start]`` lacks it).

    ``run[k] = mask & held[start] & ... & held[start + k - 1]`` only loses bits, so it is
    non-increasing as an int; between two drops it is constant, and the next drop is a bisection
    away. Cost: one C-level ``accumulate`` plus one bisection per distinct run length.
    """
    run = list(accumulate(islice(held, start, None), and_, initial=mask))
    size = len(run)
    ends: dict[int, int] = {}
    k, v = 0, mask
    while v:
        j = bisect_right(run, -v, k, size, key=neg)  # first index with run[j] < v
        if j == size:
            dropped, w = v, 0
        else:
            w = run[j]
            dropped = v & ~w
        while dropped:
            low = dropped & -dropped
            ends[low] = start + j - 1
            dropped ^= low
        k, v = j, w
    return ends
