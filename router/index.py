"""The router's block index: which replica holds which block, per medium (DESIGN.md §5). No I/O.

Per medium, one table of every replica's entries:

    hash -> the replicas holding >= 1 copy      (for lookups)
    (replica, hash) -> copies                    (reference counts, for removals)

in one of two storages with the same methods: router/_index.c's ``Table`` when it was built (open
addressing over the u64 hashes, a small set of replica ids per hash, the copy counts apart since
almost all are one; about 30 B per entry), else :class:`_DictMedium` (Python dicts: hash ->
bitmask of replica ids, and per replica {hash: copies}). Replicas get a small id each, the lowest
free one (``remove_replica`` frees it). Duplicates exist on replicas (the same hash cached in two
blocks), so a BlockRemoved of one copy only drops the entry when the last copy goes.

A lookup walks the request's hash chain from block 0 with the set of replicas still running, so
the per-block cost does not grow with the number of replicas: the first block at which a replica
drops out is its matched length (router/_index.c's ``walk``, or :func:`leading_runs` over the
bitmasks).

Speculative entries (``router/speculative.py``) credit a replica with a request's blocks right
after routing it, held until its prefill is done and for a short TTL after, so that a burst of
requests sharing a new prefix lands on one replica before its BlockStored events arrive. They count
as GPU matches in lookups and are reported separately. They live apart from the real entries (a
dict {hash: bitmask of replica ids}, bit ``1 << id``): no speculative operation drops a real entry,
and BlockRemoved / AllBlocksCleared leave them be (only forgetting the replica drops them).

Other routers' speculative entries (``set_remote_speculative``, from the load sync) join the same
mask and count in lookups as this router's own do: every router indexes the same KV events, so
what one router's index needs from another is only the entries the events have not brought yet
(``own_speculative``).
"""

from __future__ import annotations

import heapq
import time
from bisect import bisect_right
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass
from itertools import accumulate, islice, repeat
from operator import and_, neg, or_

from kvroute.events import CPU, GPU, MAX_EVENT_HASHES, MEDIA
from router.speculative import SpeculativeCredit, SpeculativeEntries

try:
    from router import _index
except ImportError:  # built without a C compiler: the Python storage and walk below
    _index = None


@dataclass(slots=True)
class Match:
    """A replica's matched prefix for one request, in blocks: ``gpu`` leading blocks on the GPU,
    then ``cpu`` more on its CPU tier; ``speculative`` of the ``gpu`` ones are speculative."""

    gpu: int = 0
    cpu: int = 0
    speculative: int = 0


class _DictMedium:
    """One medium's entries in Python dicts, the fallback of router/_index.c's ``Table`` (same
    methods and answers): ``masks`` {hash: bitmask of the replica ids holding it} for the walk, and
    per replica id {hash: copies}."""

    nbytes = 0  # Python objects: tracemalloc sees them

    def __init__(self) -> None:
        self.masks: dict[int, int] = {}
        self._counts: dict[int, dict[int, int]] = {}

    def __len__(self) -> int:
        return len(self.masks)

    @property
    def entries(self) -> int:
        return sum(map(len, self._counts.values()))

    def add(self, rid: int, hashes: Iterable[int]) -> None:
        bit = 1 << rid
        counts = self._counts.setdefault(rid, {})
        mask = self.masks
        get = counts.get
        for h in hashes:
            c = get(h, 0)
            counts[h] = c + 1
            if not c:
                mask[h] = mask.get(h, 0) | bit

    def remove(self, rid: int, hashes: Iterable[int]) -> int:
        counts = self._counts.get(rid, {})
        mask = self.masks
        keep = ~(1 << rid)
        missing = 0
        for h in hashes:
            c = counts.get(h, 0)
            if c > 1:
                counts[h] = c - 1
            elif c == 1:
                del counts[h]
                v = mask[h] & keep
                if v:
                    mask[h] = v
                else:
                    del mask[h]
            else:
                missing += 1
        return missing

    def clear(self, rid: int) -> None:
        counts = self._counts.pop(rid, {})
        mask = self.masks
        keep = ~(1 << rid)
        for h in counts:
            v = mask[h] & keep
            if v:
                mask[h] = v
            else:
                del mask[h]

    def count(self, rid: int) -> int:
        return len(self._counts.get(rid, ()))

    def copies(self, rid: int, block_hash: int) -> int:
        return self._counts.get(rid, {}).get(block_hash, 0)

    def items(self, rid: int) -> dict[int, int]:
        return dict(self._counts.get(rid, {}))

    def holders(self, block_hash: int) -> list[int]:
        mask = self.masks.get(block_hash, 0)
        return [i for i in range(mask.bit_length()) if mask >> i & 1]


class BlockIndex:
    """Exact index of cached blocks per (replica, medium), with speculative entries.

    Owns the media's tables (module docstring), the replicas' ids and the speculative entries.
    Invariant: a hash is in a medium's table for exactly the replicas holding >= 1 copy of it
    there, with their copy counts.

    Args:
        speculative_ttl: seconds a speculative entry lives (0 disables them).
        clock: monotonic clock (injectable for tests).
    """

    def __init__(self, speculative_ttl: float = 2.0, clock: Callable[[], float] = time.monotonic):
        self._ids: dict[str, int] = {}
        self._names: list[str | None] = []  # id -> replica (None: free)
        self._free_ids: list[int] = []  # a heap: the lowest is reused first, keeping the run sets narrow
        table = _index.Table if _index is not None else _DictMedium
        self._media = {m: table() for m in MEDIA}
        self._spec = SpeculativeEntries(speculative_ttl, clock)

    @property
    def speculative_ttl(self) -> float:
        return self._spec.ttl

    # -- replicas ----------------------------------------------------------------------------------
    def _id(self, replica: str) -> int:
        rid = self._ids.get(replica)
        if rid is None:
            if self._free_ids:
                rid = heapq.heappop(self._free_ids)
                self._names[rid] = replica
            else:
                rid = len(self._names)
                self._names.append(replica)
            self._ids[replica] = rid
        return rid

    @property
    def replicas(self) -> list[str]:
        return list(self._ids)

    def num_entries(self, replica: str, medium: str | None = None) -> int:
        """Distinct hashes indexed for ``replica`` (one medium, or all)."""
        rid = self._ids.get(replica)
        if rid is None:
            return 0
        return sum(self._media[m].count(rid) for m in (MEDIA if medium is None else (medium,)))

    def table_bytes(self) -> int:
        """Bytes the compiled tables hold, as each counts them (C allocations, which tracemalloc
        does not see); 0 on the Python storage."""
        return sum(t.nbytes for t in self._media.values())

    def clear_replica(self, replica: str, medium: str | None = None) -> None:
        """Drop what is known of ``replica`` (one medium, or all: AllBlocksCleared, new epoch)."""
        rid = self._ids.get(replica)
        if rid is None:
            return
        for m in MEDIA if medium is None else (medium,):
            self._media[m].clear(rid)

    def remove_replica(self, replica: str) -> None:
        """Forget ``replica`` entirely (heartbeat expired, discovery removed it); frees its id."""
        rid = self._ids.get(replica)
        if rid is None:
            return
        self.clear_replica(replica)
        self._spec.forget(1 << rid)  # its credits in flight come back void: the id may be reused
        del self._ids[replica]
        self._names[rid] = None
        heapq.heappush(self._free_ids, rid)

    # -- events ---------------------------------------------------------------------------------------
    def add(self, replica: str, hashes: Iterable[int], medium: str = GPU) -> None:
        """BlockStored: one more copy of each hash (u64 ints, the events' type) on (replica, medium)."""
        self._media[medium].add(self._id(replica), hashes)

    def remove(self, replica: str, hashes: Iterable[int], medium: str = GPU) -> int:
        """BlockRemoved: one copy fewer of each hash. Returns how many hashes were not indexed
        (a symptom of a missed event; the consumer resyncs on seq gaps anyway)."""
        rid = self._ids.get(replica)
        if rid is None:
            return sum(1 for _ in hashes)
        return self._media[medium].remove(rid, hashes)

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
        return self._spec.credit(1 << self._id(replica), hashes, hold)
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
        gpu = self._media[GPU]
        out = {}
        for bit, hashes in self._spec.own().items():
            rid = bit.bit_length() - 1
            mine = [h for h in hashes if not gpu.copies(rid, h)]
            if mine:
                out[self._names[rid]] = mine
        return out

    def set_remote_speculative(self, router: str, entries: dict[str, Sequence[int]] | None) -> None:
        """Router ``router``'s speculative entries (its :meth:`own_speculative`) replace the ones
        it gave before; None forgets that router. They count in lookups as this router's own, until
        then or until their replica is forgotten. Each replica named gets an id: the caller names
        routable replicas only (:meth:`router.core.Router.merge`), as for its own credits."""
        self._spec.set_remote(router, {1 << self._id(r): hashes for r, hashes in (entries or {}).items() if hashes})

    # -- lookup -----------------------------------------------------------------------------------------
    def matches(self, hashes: Sequence[int], replicas: Container[str] | None = None) -> dict[str, Match]:
        """:meth:`lookup`'s answer for the replicas that match at least one block (GPU, speculative
        or CPU), among ``replicas`` (a set or dict; default: every indexed replica): what the
        decision path asks, at a cost that grows with the matches and not with the replicas."""
        self._spec.expire()
        if not hashes or not self._ids:
            return {}
        chain = hashes if type(hashes) is list else list(hashes)
        gpu, cpu, spec = self._media[GPU], self._media[CPU], self._spec.mask
        if isinstance(gpu, _DictMedium):
            alive = 0
            for rid in self._ids.values():
                alive |= 1 << rid
            runs = python_walk(chain, gpu.masks, spec, cpu.masks, alive)
        else:
            runs = _index.walk(chain, gpu, spec or None, cpu, len(self._names))
        names = self._names
        out = {}
        for rid, (g, c, s) in runs.items():
            name = names[rid]
            if replicas is None or name in replicas:
                out[name] = Match(g, c, s)
        return out

    def lookup(self, hashes: Sequence[int], replicas: Iterable[str] | None = None) -> dict[str, Match]:
        """Per replica, the leading run of ``hashes`` it holds (GPU or speculative), then the run
        after that on its CPU tier (mirrors the engine's get_computed_blocks).

        Args:
            hashes: the request's block hash chain (event ints), block 0 first.
            replicas: the candidates (default: every indexed replica). Unknown ones match 0.

        Returns:
            ``{replica: Match}`` for every candidate.
        """
        names = list(self._ids) if replicas is None else list(replicas)
        found = self.matches(hashes)
        return {r: found.get(r) or Match() for r in names}

    def has(self, replica: str, block_hash: int, medium: str = GPU) -> bool:
        rid = self._ids.get(replica)
        return rid is not None and self._media[medium].copies(rid, block_hash) > 0

    def cached_set(self, replica: str, medium: str = GPU) -> dict[int, int]:
        """A copy of ``{hash: copies}`` for (replica, medium) (tests, debugging)."""
        rid = self._ids.get(replica)
        return {} if rid is None else self._media[medium].items(rid)


def decode_events(data: bytes, block_size: int) -> tuple[float, list[tuple[str | None, str, Sequence[int]]]] | None:
    """A KVEventBatch's bytes as the index applies them, ``(ts, [(kind, medium, hashes)])``, read
    by router/_index.c's ``decode_batch`` (hashes as u64 arrays that :meth:`BlockIndex.add` reads
    as they are; token ids counted, not decoded). None when it is not built, when the bytes are
    not in the form replicas write, or when the batch has a problem
    (``kvroute.events.batch_problem``): the caller parses those with protobuf."""
    return None if _index is None else _index.decode_batch(data, block_size, MAX_EVENT_HASHES)


def python_walk(hashes: list[int], gpu: dict[int, int], spec: dict[int, int], cpu: dict[int, int],
                alive: int) -> dict[int, tuple[int, int, int]]:
    """router/_index.c's ``walk`` over bitmask dicts {hash: mask of replica ids}: for each id of
    ``alive`` that matches a block, ``(gpu, cpu, speculative)`` as in :class:`Match`."""
    n = len(hashes)
    gpu_end = leading_runs(hashes, (gpu, spec) if spec else (gpu,), 0, alive)
    # A replica's real run ends at its first block held only speculatively.
    real_end = leading_runs(hashes, (gpu,), 0, alive) if spec else gpu_end
    cpu_len: dict[int, int] = {}
    if cpu:
        starts: dict[int, int] = {}  # run start -> replicas starting there
        for b, end in gpu_end.items():
            if end < n:
                starts[end] = starts.get(end, 0) | b
        for start, mask in starts.items():
            for b, end in leading_runs(hashes, (cpu,), start, mask).items():
                if end > start:
                    cpu_len[b] = end - start
    return {b.bit_length() - 1: (end, cpu_len.get(b, 0), end - real_end[b])
            for b, end in gpu_end.items() if end or b in cpu_len}


def leading_runs(hashes: list[int], dicts: tuple[dict[int, int], ...], start: int, mask: int) -> dict[int, int]:
    """For each bit of ``mask``: where its run of consecutive blocks from ``start`` ends, a block
    being held when the OR of ``d.get(h, 0)`` over ``dicts`` carries the bit (:func:`_run_ends`).
    ``map(dict.get)`` + ``itertools.accumulate`` instead of a Python loop per block."""
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
