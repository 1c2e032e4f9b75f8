"""KV blocks and the free queue (vLLM v1 ``kv_cache_utils`` semantics, DESIGN.md §3.1)."""

from __future__ import annotations

from collections.abc import Iterable


class KVCacheBlock:
    """One physical KV block: its id, how many requests use it, and its prefix-cache hash.

    ``block_hash`` is the full digest of the block's chain position (kvroute.hashing) while the block
    is registered in the prefix cache, else None. ``event_hash`` is its 64-bit event int.
    ``prev_free_block`` / ``next_free_block`` are owned by :class:`FreeKVCacheBlockQueue`.
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "event_hash", "prev_free_block", "next_free_block", "is_null")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.event_hash: int | None = None
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.is_null = False

    def __repr__(self) -> str:
        h = None if self.event_hash is None else f"{self.event_hash:#x}"
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={h})"


class FreeKVCacheBlockQueue:
    """The free blocks, in eviction order: the head is handed out (and evicted) first.

    An intrusive doubly linked list threaded through the blocks themselves, between two sentinel
    nodes, so that popleft, append and removal from the middle (a prefix hit on a free cached block)
    are all O(1) with no allocation. A Python deque would make the removal O(n).
    Invariant: a block is in the queue iff its ref_cnt is 0 (the null block is never in it).
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]):
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def popleft(self) -> KVCacheBlock:
        """Remove and return the head. Raises ValueError when empty."""
        block = self._head.next_free_block
        if block is self._tail:
            raise ValueError("no free blocks")
        self._unlink(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the first ``n`` blocks. Raises ValueError when fewer are free.

        Walks the ``n`` nodes once and relinks the head a single time (a call per block costs
        several times more; bench/kv_manager.py times the pool).
        """
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, {self.num_free_blocks} free")
        out: list[KVCacheBlock] = []
        if n <= 0:
            return out
        append = out.append
        node = self._head.next_free_block
        for _ in range(n):
            append(node)
            nxt = node.next_free_block
            node.prev_free_block = node.next_free_block = None
            node = nxt
        self._head.next_free_block = node
        node.prev_free_block = self._head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        """Take ``block`` out of the middle of the queue. Raises ValueError if it is not queued."""
        if block.prev_free_block is None or block.next_free_block is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        self._unlink(block)

    def append(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the tail (evicted last)."""
        self._link(block, self._tail.prev_free_block, self._tail)

    def appendleft(self, block: KVCacheBlock) -> None:
        """Put ``block`` at the head (handed out next)."""
        self._link(block, self._head, self._head.next_free_block)

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Put ``blocks`` at the tail, in order (the last one is evicted last)."""
        tail = self._tail
        self._splice(blocks, tail.prev_free_block, tail)

    def prepend_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Put ``blocks`` at the head, in order (the first one is handed out next)."""
        head = self._head
        self._splice(blocks, head, head.next_free_block)

    def _splice(self, blocks: Iterable[KVCacheBlock], prev: KVCacheBlock, nxt: KVCacheBlock) -> None:
        """Link ``blocks`` as a chain between the adjacent nodes ``prev`` and ``nxt`` (one pass)."""
        n = 0
        try:
            for b in blocks:
                if b.next_free_block is not None or b.prev_free_block is not None:
                    raise ValueError(f"block {b.block_id} is already in the free queue")
                b.prev_free_block = prev
                prev.next_free_block = b
                prev = b
                n += 1
        finally:  # close the chain even on error, so that the queue stays consistent
            prev.next_free_block = nxt
            nxt.prev_free_block = prev
            self.num_free_blocks += n

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The queued blocks from head to tail (for tests and snapshots; O(n))."""
        out, node = [], self._head.next_free_block
        while node is not self._tail:
            out.append(node)
            node = node.next_free_block
        return out

    def _link(self, block: KVCacheBlock, prev: KVCacheBlock, nxt: KVCacheBlock) -> None:
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        block.prev_free_block, block.next_free_block = prev, nxt
        prev.next_free_block = block
        nxt.prev_free_block = block
        self.num_free_blocks += 1

    def _unlink(self, block: KVCacheBlock) -> None:
        block.prev_free_block.next_free_block = block.next_free_block
        block.next_free_block.prev_free_block = block.prev_free_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1
