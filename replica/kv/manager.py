"""KVCacheManager: per-request block tables over the BlockPool, with prefix caching (DESIGN.md §3.1).

Follows vLLM v1's ``KVCacheManager``: the scheduler asks ``get_computed_blocks`` once when it
admits a request, then ``allocate_slots`` every step the request runs, and ``free`` when it
finishes or is preempted.
"""

from __future__ import annotations

from array import array
from collections.abc import Container, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from kvroute.events import KVCacheEvent
from kvroute.hashing import BlockHasher, BlockHashKeys
from replica.kv.block import KVCacheBlock
from replica.kv.block_pool import BlockPool, FreeOrder, KVCacheError
from replica.kv.cpu_pool import CopyFn
from replica.kv.stats import PrefixCacheStats

# _check_token_ids checks ranges up to this many tokens in plain Python (see there).
_SHORT_RANGE = 16
_NO_LIMIT = float("inf")


class KVRequest(Protocol):
    """What the manager reads of a request. ``block_hashes`` is the manager's cache of the full
    digests of the request's full blocks (it only appends to it); the scheduler owns the rest."""

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int
    hash_keys: BlockHashKeys
    lora_name: str | None
    block_hashes: list[bytes]
    num_preemptions: int  # > 0: a re-admission after preemption (counted apart in the stats)

    @property
    def num_tokens(self) -> int: ...


@dataclass
class SimpleKVRequest:
    """A minimal :class:`KVRequest` (tests, benchmarks, the simulator)."""

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    hash_keys: BlockHashKeys = field(default_factory=BlockHashKeys)
    lora_name: str | None = None
    block_hashes: list[bytes] = field(default_factory=list)
    num_preemptions: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def append_output_token_ids(self, token_ids: int | Sequence[int]) -> None:
        self.all_token_ids.extend([token_ids] if isinstance(token_ids, int) else token_ids)


@dataclass
class ComputedBlocks:
    """The prefix hits of a request: GPU blocks, then the digests found only on the CPU tier."""

    blocks: list[KVCacheBlock]
    cpu_block_hashes: list[bytes]
    block_size: int
    # get_computed_blocks validated this request's first ``checked_tokens`` ids: allocate_slots,
    # given these hits for the same request, does not check them again.
    checked_request: str | None = None
    checked_tokens: int = 0

    @property
    def num_computed_tokens(self) -> int:
        return (len(self.blocks) + len(self.cpu_block_hashes)) * self.block_size

    @property
    def num_cpu_hit_tokens(self) -> int:
        return len(self.cpu_block_hashes) * self.block_size


class KVCacheManager:
    """Block tables per request on top of a :class:`BlockPool`.

    Owns ``req_to_blocks`` (each running request's block table, append-only while it runs) and
    ``num_cached_block`` (how many leading blocks of each table are registered in the prefix cache).

    Args:
        num_blocks: physical GPU blocks including the null block 0.
        block_size: tokens per block (B).
        hasher: the block hasher; its block_size must equal ``block_size``.
        enable_caching: prefix caching on/off.
        max_model_len: slots are never allocated past this many tokens per request.
        vocab_size: when set, token ids outside [0, vocab_size) are rejected.
        free_order: "lru" (default) or "fifo" (see BlockPool).
        cpu_num_blocks / copy_fn: the optional CPU tier and the engine's block copy.

    Raises:
        ValueError: inconsistent arguments.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        hasher: BlockHasher | None = None,
        enable_caching: bool = True,
        max_model_len: int | None = None,
        vocab_size: int | None = None,
        free_order: FreeOrder = "lru",
        enable_kv_cache_events: bool = True,
        cpu_num_blocks: int = 0,
        copy_fn: CopyFn | None = None,
    ):
        if block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {block_size}")
        self.hasher = hasher or BlockHasher(block_size=block_size)
        if self.hasher.block_size != block_size:
            raise ValueError(f"block_size: hasher uses {self.hasher.block_size}, manager {block_size}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.block_pool = BlockPool(
            num_blocks, enable_caching, enable_kv_cache_events, free_order, cpu_num_blocks, copy_fn
        )
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # What allocate_slots uses when it gets no prefix hits; only ever read.
        self._no_hits = ComputedBlocks([], [], block_size)
        self.num_cached_block: dict[str, int] = {}
        self.stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        """KV cache usage in [0, 1]: 1 - free / (num_blocks - 1)."""
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    # -- hashing -------------------------------------------------------------------------------
    def _check_token_ids(self, request: KVRequest, start: int, end: int) -> None:
        if end <= start:
            return
        if end - start <= _SHORT_RANGE:
            # A decode checks its one new token every step: plain Python on a short slice is far
            # cheaper than numpy's asarray + min + max. Anything unusual (a non-int
            # type, an id out of range) takes the numpy path, which raises the error.
            vocab = self.vocab_size if self.vocab_size is not None else _NO_LIMIT
            for tok in request.all_token_ids[start:end]:
                if type(tok) is not int or not 0 <= tok < vocab:
                    break
            else:
                return
        ids = request.all_token_ids[start:end]
        try:
            # array('Q') converts a list faster than np.asarray, and the conversion itself refuses
            # non-integers (TypeError) and negative ids (OverflowError): only the vocabulary's
            # upper bound is left to check.
            top = int(np.frombuffer(array("Q", ids), dtype=np.uint64).max())
        except TypeError as e:
            raise KVCacheError(f"request {request.request_id!r}: token ids must be integers") from e
        except OverflowError:
            bad = next((t for t in ids if t < 0 or t >= 2**64), None)
            raise KVCacheError(
                f"request {request.request_id!r}: token id {bad} outside the vocabulary [0, {self.vocab_size})"
            ) from None
        if self.vocab_size is not None and top >= self.vocab_size:
            raise KVCacheError(
                f"request {request.request_id!r}: token id {top} outside the vocabulary [0, {self.vocab_size})"
            )

    def _update_block_hashes(self, request: KVRequest) -> list[bytes]:
        """Extend ``request.block_hashes`` to cover every full block of its tokens."""
        hashes = request.block_hashes
        B = self.block_size
        num_full = request.num_tokens // B
        if len(hashes) < num_full:
            start = len(hashes)
            hashes.extend(
                self.hasher.hash_blocks(
                    request.all_token_ids[start * B : num_full * B],
                    request.hash_keys,
                    parent=hashes[-1] if hashes else None,
                    start_block=start,
                )
            )
        return hashes

    def expected_hit_blocks(self, request: KVRequest, pending: Container[bytes] = ()) -> int:
        """Leading blocks a lookup would serve if the request were admitted now: the cached prefix
        :meth:`get_computed_blocks` would find, extended by blocks in ``pending`` (to be computed by
        a request queued ahead of it), within the same cap. No side effects, no validation (an
        estimate for the load the replica reports).
        """
        if not self.enable_caching or request.num_tokens == 0:
            return 0
        blocks, cpu = self._cached_prefix(request)
        n, hashes = len(blocks) + len(cpu), request.block_hashes
        max_hit = (request.num_tokens - 1) // self.block_size
        while n < max_hit and hashes[n] in pending:
            n += 1
        return n

    def _cached_prefix(self, request: KVRequest) -> tuple[list[KVCacheBlock], list[bytes]]:
        """The lookup rule (:meth:`get_computed_blocks`): the leading GPU blocks, then CPU-tier
        hashes, of at most ``(num_tokens - 1) // block_size`` blocks, stopping at the first miss."""
        hashes = self._update_block_hashes(request)
        max_hit = (request.num_tokens - 1) // self.block_size
        blocks: list[KVCacheBlock] = []
        cpu: list[bytes] = []
        cpu_pool = self.block_pool.cpu_pool
        for block_hash in hashes[:max_hit]:
            block = None if cpu else self.block_pool.get_cached_block(block_hash)
            if block is not None:
                blocks.append(block)
            elif cpu_pool is not None and block_hash in cpu_pool:
                cpu.append(block_hash)
            else:
                break
        return blocks, cpu

    # -- the three verbs -------------------------------------------------------------------------
    def get_computed_blocks(self, request: KVRequest) -> ComputedBlocks:
        """The longest cached prefix of a request about to be admitted (no side effects on the pool).

        Looks up at most ``(num_tokens - 1) // block_size`` leading blocks, stopping at the first
        miss: the last prompt token is always recomputed so that the step produces logits. A block
        missing on the GPU but present on the CPU tier extends the hit (it is copied back when
        ``allocate_slots`` takes it).

        Raises:
            KVCacheError: the request already holds blocks, or a token id is outside the vocabulary.
        """
        if request.request_id in self.req_to_blocks:
            raise KVCacheError(f"get_computed_blocks: request {request.request_id!r} already holds blocks")
        self._check_token_ids(request, 0, request.num_tokens)
        checked = (request.request_id, request.num_tokens)
        if not self.enable_caching or request.num_tokens == 0:
            return ComputedBlocks([], [], self.block_size, *checked)
        blocks, cpu = self._cached_prefix(request)
        return ComputedBlocks(blocks, cpu, self.block_size, *checked)

    def allocate_slots(
        self,
        request: KVRequest,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: ComputedBlocks | None = None,
        num_lookahead_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Give the request slots for ``num_new_tokens`` more tokens, or change nothing.

        Token layout of the request's block table after the call::

            | < computed (in table) > | < new computed (prefix hits) > | < new > | < lookahead > |
            |  num_computed_tokens    |    num_new_computed_tokens     |         |               |
            |<------------------ already cached ------------------->|
                                      blocks [num_cached, full) are registered in the prefix
                                      cache now, at scheduling time, before they are computed

        Blocks that become full with the new tokens are cached immediately (vLLM v1 does the
        same): a request scheduled later in the same step may already hit them.

        Args:
            request: the request; ``request.num_computed_tokens`` tokens already have slots.
            num_new_tokens: tokens to compute this step (> 0).
            num_new_computed_tokens: prefix-hit tokens from ``new_computed_blocks`` (first
                allocation only).
            new_computed_blocks: what ``get_computed_blocks`` returned.
            num_lookahead_tokens: extra slots (speculative decoding); never cached.

        Returns:
            The newly allocated blocks, or None when too few blocks are free (nothing changed).

        Raises:
            KVCacheError: negative or zero counts, prefix hits passed to a running request, or a
                token id outside the vocabulary. Nothing is changed then.
        """
        rid = request.request_id
        if num_new_tokens <= 0:
            raise KVCacheError(f"allocate_slots: num_new_tokens must be > 0, got {num_new_tokens} ({rid!r})")
        if num_new_computed_tokens < 0:
            raise KVCacheError(f"allocate_slots: num_new_computed_tokens must be >= 0, got {num_new_computed_tokens}")
        if num_lookahead_tokens < 0:
            raise KVCacheError(f"allocate_slots: num_lookahead_tokens must be >= 0, got {num_lookahead_tokens}")
        if request.num_computed_tokens < 0:
            raise KVCacheError(f"allocate_slots: request {rid!r} has num_computed_tokens < 0")
        computed = new_computed_blocks or self._no_hits
        hit_tokens = computed.num_computed_tokens
        if num_new_computed_tokens != hit_tokens:
            raise KVCacheError(
                f"allocate_slots: num_new_computed_tokens={num_new_computed_tokens} but the computed blocks"
                f" cover {hit_tokens} tokens"
            )
        first = rid not in self.req_to_blocks
        if not first and hit_tokens:
            raise KVCacheError(f"allocate_slots: request {rid!r} is running; prefix hits apply at admission only")
        B = self.block_size
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        if num_computed_tokens + num_new_tokens > request.num_tokens:
            raise KVCacheError(
                f"allocate_slots: request {rid!r} has {request.num_tokens} tokens, asked to compute up to"
                f" {num_computed_tokens + num_new_tokens}"
            )
        check_from = num_computed_tokens
        if computed.checked_request == rid:
            check_from = max(check_from, computed.checked_tokens)
        self._check_token_ids(request, check_from, num_computed_tokens + num_new_tokens)
        if self.max_model_len is not None and num_computed_tokens + num_new_tokens > self.max_model_len:
            raise KVCacheError(
                f"allocate_slots: request {rid!r} would hold {num_computed_tokens + num_new_tokens} tokens,"
                f" more than max_model_len={self.max_model_len}"
            )
        num_tokens_need_slot = num_computed_tokens + num_new_tokens + num_lookahead_tokens
        if self.max_model_len is not None:
            # Lookahead slots past max_model_len would never be used (vLLM caps them the same way).
            num_tokens_need_slot = min(num_tokens_need_slot, self.max_model_len)
        req_blocks = self.req_to_blocks.get(rid, [])
        num_required_blocks = -(-num_tokens_need_slot // B)
        num_new_blocks = max(0, num_required_blocks - len(req_blocks) - len(computed.blocks))
        # A prefix hit on a free cached block takes that block off the free queue, so it counts
        # against the free blocks just like a new allocation.
        num_evictable_hits = sum(1 for b in computed.blocks if b.ref_cnt == 0) if computed.blocks else 0
        if num_new_blocks > self.block_pool.get_num_free_blocks() - num_evictable_hits:
            return None

        pool = self.block_pool
        if first:
            self.stats.record(request.num_tokens, hit_tokens, computed.num_cpu_hit_tokens,
                              preempted=request.num_preemptions > 0)
            self.req_to_blocks[rid] = req_blocks
            self.num_cached_block[rid] = len(computed.blocks)
        if computed.blocks:
            pool.touch(computed.blocks)
            req_blocks.extend(computed.blocks)
        if computed.cpu_block_hashes:
            pool.cpu_pool.pin(computed.cpu_block_hashes)
        new_blocks = pool.get_new_blocks(num_new_blocks) if num_new_blocks else []
        req_blocks.extend(new_blocks)
        if computed.cpu_block_hashes:
            pool.restore_from_cpu(computed.cpu_block_hashes, new_blocks[: len(computed.cpu_block_hashes)])
        if self.enable_caching:
            self._cache_blocks(request, min(num_computed_tokens + num_new_tokens, request.num_tokens))
        return new_blocks

    def _cache_blocks(self, request: KVRequest, num_tokens: int) -> None:
        rid = request.request_id
        num_cached = self.num_cached_block[rid]
        num_full = num_tokens // self.block_size
        if num_cached >= num_full:
            return
        hashes = self._update_block_hashes(request)
        keys = request.hash_keys
        extras = None if keys.empty else [keys.extra_for_block(i, self.block_size) for i in range(num_full)]
        self.block_pool.cache_full_blocks(
            self.req_to_blocks[rid],
            hashes,
            num_cached,
            num_full,
            self.block_size,
            request.all_token_ids,
            request.lora_name,
            extras,
        )
        self.num_cached_block[rid] = num_full

    def free(self, request: KVRequest) -> None:
        """Release the request's blocks, tail first, so that its last blocks are evicted first.

        Raises:
            KVCacheError: the request holds no blocks (never allocated, or already freed).
        """
        blocks = self.req_to_blocks.pop(request.request_id, None)
        if blocks is None:
            raise KVCacheError(f"free: unknown request {request.request_id!r} (never allocated or already freed)")
        self.num_cached_block.pop(request.request_id, None)
        self.block_pool.free_blocks(blocks[::-1])

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table as ids. Raises KVCacheError for an unknown request."""
        try:
            return [b.block_id for b in self.req_to_blocks[request_id]]
        except KeyError:
            raise KVCacheError(f"get_block_ids: unknown request {request_id!r}") from None

    def reset_prefix_cache(self, *, must_succeed: bool = False) -> bool:
        """``BlockPool.reset_prefix_cache``: drop every cached block when none is in use."""
        return self.block_pool.reset_prefix_cache(must_succeed=must_succeed)

    def take_events(self) -> list[KVCacheEvent]:
        """KV cache events since the last call, in order (a step's removals before its stores)."""
        return self.block_pool.take_events()

    def cached_event_hashes(self) -> dict[str, list[int]]:
        """The cached set per medium ("GPU", "CPU"), one entry per copy."""
        return self.block_pool.cached_event_hashes()
