"""The pool of physical KV blocks with the prefix-cache map (vLLM v1 ``block_pool`` semantics)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from kvroute.events import CPU, GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvroute.hashing import ExtraKeys, to_event_int
from replica.kv.block import FreeKVCacheBlockQueue, KVCacheBlock
from replica.kv.cpu_pool import CopyFn, CpuBlockPool

FreeOrder = Literal["lru", "fifo"]


class KVCacheError(RuntimeError):
    """Misuse of the KV cache (double free, unknown request, bad counts); the message names it."""


class BlockPool:
    """Owns every physical block, the free queue and the map ``digest -> {block_id: block}``.

    Invariants: block 0 is the null block and is never handed out; a block is in the free queue iff
    its ref_cnt is 0; a block is in the map iff its ``block_hash`` is set. A cached block whose
    ref_cnt drops to 0 stays cached (and findable) until it is popped from the free queue's head,
    which evicts it. The same digest may be cached in several blocks: we never de-duplicate, so that
    block tables stay append-only (a request keeps the block it computed into).

    Free order: ``"lru"`` (default) puts blocks without a hash at the head (reused first: they hold
    nothing reusable) and hashed blocks at the tail; ``"fifo"`` appends every freed block to the
    tail, which reproduces vLLM's design-doc example.

    Events (when enabled) are buffered in order: a step's BlockRemoved come before its BlockStored
    because eviction happens when blocks are handed out, before the new full blocks are registered.
    """

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        enable_kv_cache_events: bool = True,
        free_order: FreeOrder = "lru",
        cpu_num_blocks: int = 0,
        copy_fn: CopyFn | None = None,
    ):
        if num_blocks < 2:
            raise ValueError(f"num_blocks: must be >= 2 (block 0 is the null block), got {num_blocks}")
        if free_order not in ("lru", "fifo"):
            raise ValueError(f"free_order: expected 'lru' or 'fifo', got {free_order!r}")
        if cpu_num_blocks and copy_fn is None:
            raise ValueError("copy_fn: required when cpu_num_blocks > 0")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.free_order = free_order
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.cached_block_hash_to_block: dict[bytes, dict[int, KVCacheBlock]] = {}
        self.cpu_pool = CpuBlockPool(cpu_num_blocks) if cpu_num_blocks else None
        self._copy_fn = copy_fn
        self._events: list[KVCacheEvent] = []

    # -- lookup -------------------------------------------------------------------------------
    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        """Any GPU block cached under ``block_hash`` (the first registered), else None."""
        copies = self.cached_block_hash_to_block.get(block_hash)
        return next(iter(copies.values())) if copies else None

    # -- allocation ---------------------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` from the free queue's head, evicting any cached ones; ref_cnt becomes 1.

        Raises:
            KVCacheError: fewer than ``num_blocks`` are free.
        """
        free = self.free_block_queue.num_free_blocks
        if num_blocks > free:
            raise KVCacheError(f"get_new_blocks: asked for {num_blocks} blocks, {free} free")
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Take prefix hits: bump ref_cnt, pulling blocks with ref_cnt 0 out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Sequence[KVCacheBlock]) -> None:
        """Drop one reference to each block, in the given order (callers pass tail blocks first).

        Blocks reaching ref_cnt 0 join the free queue per the free order and stay cached.

        Raises:
            KVCacheError: a block's ref_cnt is already 0 (double free); nothing is changed then.
        """
        # Decrement first and roll back on error, so that a block listed twice in one call is caught
        # as the double free it is (checking ref_cnt > 0 up front would let it reach -1). Blocks
        # reaching 0 are then linked into the free queue in one splice per end.
        null = self.null_block
        freed: list[KVCacheBlock] = []
        for i, block in enumerate(ordered_blocks):
            if block is null:
                continue
            ref_cnt = block.ref_cnt
            if ref_cnt <= 0:
                for b in ordered_blocks[:i]:
                    if b is not null:
                        b.ref_cnt += 1
                raise KVCacheError(f"double free of block {block.block_id} (ref_cnt is already 0)")
            block.ref_cnt = ref_cnt - 1
            if ref_cnt == 1:
                freed.append(block)
        if not freed:
            return
        if self.free_order == "fifo":
            self.free_block_queue.append_n(freed)
            return
        head: list[KVCacheBlock] = []
        tail: list[KVCacheBlock] = []
        for block in freed:
            (head if block.block_hash is None else tail).append(block)
        if head:
            # Same order as calling appendleft on each in turn: the last one freed is reused first.
            head.reverse()
            self.free_block_queue.prepend_n(head)
        if tail:
            self.free_block_queue.append_n(tail)

    # -- prefix cache -------------------------------------------------------------------------
    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[bytes],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        token_ids: Sequence[int],
        lora_name: str | None = None,
        extra_keys: Sequence[ExtraKeys] | None = None,
    ) -> None:
        """Register ``blocks[num_cached_blocks:num_full_blocks]`` under their digests; one BlockStored.

        ``token_ids`` are the request's tokens (at least ``num_full_blocks * block_size``);
        ``extra_keys[i]`` is block i's extra (None or all-None means no extra keys).
        """
        if num_cached_blocks >= num_full_blocks:
            return
        new_event_hashes: list[int] = []
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.block_hash is not None:
                raise KVCacheError(f"cache_full_blocks: block {block.block_id} is already cached")
            block.block_hash = block_hashes[i]
            block.event_hash = to_event_int(block_hashes[i])
            self.cached_block_hash_to_block.setdefault(block.block_hash, {})[block.block_id] = block
            new_event_hashes.append(block.event_hash)
        if not self.enable_kv_cache_events:
            return
        extras = None
        if extra_keys is not None and any(e is not None for e in extra_keys[num_cached_blocks:num_full_blocks]):
            extras = tuple(extra_keys[num_cached_blocks:num_full_blocks])
        parent = to_event_int(block_hashes[num_cached_blocks - 1]) if num_cached_blocks > 0 else None
        self._events.append(
            BlockStored(
                block_hashes=tuple(new_event_hashes),
                parent_block_hash=parent,
                token_ids=tuple(token_ids[num_cached_blocks * block_size : num_full_blocks * block_size]),
                block_size=block_size,
                lora_name=lora_name,
                medium=GPU,
                extra_keys=extras,
            )
        )

    def _evict(self, block: KVCacheBlock) -> None:
        """Drop ``block`` from the GPU map (offloading it to the CPU tier when there is one)."""
        block_hash, event_hash = block.block_hash, block.event_hash
        copies = self.cached_block_hash_to_block[block_hash]
        del copies[block.block_id]
        if not copies:
            del self.cached_block_hash_to_block[block_hash]
        block.block_hash = block.event_hash = None
        self._emit(BlockRemoved(block_hashes=(event_hash,), medium=GPU))
        if self.cpu_pool is not None and block_hash not in self.cpu_pool and not copies:
            slot, evicted = self.cpu_pool.reserve(block_hash, event_hash)
            if evicted:
                self._emit(BlockRemoved(block_hashes=tuple(evicted), medium=CPU))
            if slot is not None:
                self._copy_fn("to_cpu", block.block_id, slot)
                self._emit(BlockStored((event_hash,), None, (), 0, None, CPU, None))

    def restore_from_cpu(self, block_hashes: Sequence[bytes], blocks: Sequence[KVCacheBlock]) -> None:
        """Copy CPU-tier blocks back into freshly allocated GPU ``blocks`` (same order); unpins them."""
        assert self.cpu_pool is not None
        for block_hash, block in zip(block_hashes, blocks, strict=True):
            self._copy_fn("to_gpu", self.cpu_pool.slot(block_hash), block.block_id)
        self.cpu_pool.unpin(block_hashes)

    def reset_prefix_cache(self, *, must_succeed: bool = False) -> bool:
        """Forget every cached digest (GPU and CPU) when no block is in use; emits AllBlocksCleared.

        Args:
            must_succeed: a refusal raises instead of returning False (warm-ups and benchmarks,
                whose numbers would otherwise silently include a warm cache).

        Returns:
            False (and changes nothing) when some block is still referenced.

        Raises:
            KVCacheError: refused with ``must_succeed``; the message says how many blocks are held.
        """
        in_use = self.num_blocks - 1 - self.get_num_free_blocks()
        if in_use and must_succeed:
            raise KVCacheError(f"reset_prefix_cache: refused, {in_use} blocks are in use; finish or abort their requests first")
        if in_use:
            return False
        for copies in self.cached_block_hash_to_block.values():
            for block in copies.values():
                block.block_hash = block.event_hash = None
        self.cached_block_hash_to_block.clear()
        if self.cpu_pool is not None:
            self.cpu_pool.clear()
        self._emit(AllBlocksCleared(medium=None))
        return True

    # -- events and stats ---------------------------------------------------------------------
    def _emit(self, event: KVCacheEvent) -> None:
        if self.enable_kv_cache_events:
            self._events.append(event)

    def take_events(self) -> list[KVCacheEvent]:
        """The events since the last call, in order."""
        events, self._events = self._events, []
        return events

    def get_usage(self) -> float:
        """Fraction of usable blocks in use: 1 - free / (num_blocks - 1); cached-but-free is free."""
        return 1.0 - self.get_num_free_blocks() / (self.num_blocks - 1)

    def cached_event_hashes(self) -> dict[str, list[int]]:
        """The cached set per medium, one entry per copy (for snapshots and tests)."""
        gpu = [b.event_hash for copies in self.cached_block_hash_to_block.values() for b in copies.values()]
        return {GPU: gpu, CPU: self.cpu_pool.event_hashes() if self.cpu_pool else []}
