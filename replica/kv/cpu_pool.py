"""The CPU tier of the prefix cache: an LRU pool of offloaded blocks (DESIGN.md §3.1)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

# copy_fn(direction, src_block_id, dst_block_id): "to_cpu" copies GPU block src into CPU slot dst,
# "to_gpu" copies CPU slot src into GPU block dst. The engine provides it; it must complete before
# the GPU block is written again (the next forward).
CopyFn = Callable[[str, int, int], None]


class CpuBlockPool:
    """``capacity`` CPU slots holding offloaded blocks, keyed by digest, in LRU order.

    Owns the map digest -> (slot, event int); the OrderedDict's order is the eviction order (first =
    least recently used). A pinned digest (about to be copied back to the GPU) is never evicted.
    Evictions are reported by returning the evicted event ints; the caller emits the events.
    """

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"cpu_num_blocks: must be >= 1, got {capacity}")
        self.capacity = capacity
        self._entries: OrderedDict[bytes, tuple[int, int]] = OrderedDict()
        self._free_slots = list(range(capacity - 1, -1, -1))
        self._pinned: set[bytes] = set()

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def slot(self, block_hash: bytes) -> int:
        """The slot holding ``block_hash`` (marks it most recently used). KeyError if absent."""
        self._entries.move_to_end(block_hash)
        return self._entries[block_hash][0]

    def pin(self, hashes: Iterable[bytes]) -> None:
        self._pinned.update(hashes)

    def unpin(self, hashes: Iterable[bytes]) -> None:
        self._pinned.difference_update(hashes)

    def reserve(self, block_hash: bytes, event_hash: int) -> tuple[int | None, list[int]]:
        """Make room for ``block_hash`` and register it as most recently used.

        Returns:
            ``(slot, evicted)``: the slot to copy into (None when every slot is pinned, in which case
            nothing is stored) and the event ints of the entries evicted to make room.
        """
        evicted: list[int] = []
        if not self._free_slots:
            victim = next((h for h in self._entries if h not in self._pinned), None)
            if victim is None:
                return None, evicted
            slot, victim_event = self._entries.pop(victim)
            self._free_slots.append(slot)
            evicted.append(victim_event)
        slot = self._free_slots.pop()
        self._entries[block_hash] = (slot, event_hash)
        return slot, evicted

    def event_hashes(self) -> list[int]:
        """The event ints of every cached entry (LRU first)."""
        return [e for _, e in self._entries.values()]

    def clear(self) -> None:
        self._entries.clear()
        self._pinned.clear()
        self._free_slots = list(range(self.capacity - 1, -1, -1))
