"""Chained block hashing: the contract router and replicas must never drift on (DESIGN.md §2).

Only full blocks of ``block_size`` tokens are hashed::

    h_-1 = NONE_HASH = H(CBOR_canonical(seed))
    h_i  = H(CBOR_canonical((h_{i-1}, tuple(tokens[i*B:(i+1)*B]), extra_i)))

with ``H`` SHA-256 (``sha256_cbor``, vLLM's default) or XXH3-128 (``xxhash_cbor``). ``extra_i`` is a
tuple of tagged keys or ``None``: ``("lora", name, path)`` on every block of a LoRA request,
``("mm", identifier, offset - block_start)`` per multimodal item overlapping the block, and
``("cache_salt", salt)`` on block 0 only, in that order. The chain carries full digests; the index
key and event value is the digest's last 8 bytes as a big-endian unsigned 64-bit int.

Fast path: instead of building a Python tuple per block and running ``cbor2.dumps`` on it, the CBOR
encoding of every token of the prompt is produced in one vectorised numpy pass, and each block's
hash input is assembled as ``0x83 | bytes-header | parent | array-header | token bytes | extra``.
The bytes are identical to ``cbor2.dumps((parent, tokens, extra), canonical=True)`` (tests check it
with hypothesis); measured in ``bench/kv_manager.py``.
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import cbor2
import numpy as np
import xxhash

HashAlgorithm = Literal["sha256_cbor", "xxhash_cbor"]
HASH_ALGORITHMS: tuple[str, ...] = ("sha256_cbor", "xxhash_cbor")
DEFAULT_SEED = "vllm-none-hash"
DEFAULT_BLOCK_SIZE = 16

ExtraKeys = tuple[tuple, ...] | None  # the extra of one block, as hashed


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


_DIGESTS = {"sha256_cbor": _sha256, "xxhash_cbor": xxhash.xxh3_128_digest}


def to_event_int(digest: bytes) -> int:
    """The 64-bit index key / event value of a block digest: its last 8 bytes, big-endian, unsigned."""
    return int.from_bytes(digest[-8:], "big")


def _cbor_head(major: int, n: int) -> bytes:
    """CBOR initial byte(s) for major type ``major`` with argument ``n`` (shortest form, RFC 8949 §3)."""
    m = major << 5
    if n < 24:
        return bytes((m | n,))
    if n < 0x100:
        return bytes((m | 24, n))
    if n < 0x10000:
        return bytes((m | 25,)) + n.to_bytes(2, "big")
    if n < 0x100000000:
        return bytes((m | 26,)) + n.to_bytes(4, "big")
    return bytes((m | 27,)) + n.to_bytes(8, "big")


# CBOR size classes of an unsigned int (RFC 8949 §3, shortest form): 0: n < 24 (1 byte),
# 1: < 2**8 (2), 2: < 2**16 (3), 3: < 2**32 (5).
_CLASS_SIZE = np.array([1, 2, 3, 5], dtype=np.int8)
_CLASS_HEAD_BYTE = (0, 0x18, 0x19, 0x1A)
_NULL = b"\xf6"  # CBOR null: the extra of a block without extra keys


def _row_kind(width: int, native: type) -> tuple[np.dtype, np.ndarray, np.ndarray]:
    """Tables for rows of ``width`` bytes: (big-endian row dtype, per class the head shifted to sit
    right before the value's significant bytes, per suffix length s the ``width``-byte pattern of
    ``width - s`` zero bytes then s one bytes, as one native int whose bytes ``.view(bool)`` reads)."""
    classes = 3 if width == 4 else 4  # a 4-byte row holds ints below 2**16; 5-byte ints need 8
    heads = np.array([_CLASS_HEAD_BYTE[c] << 8 * int(_CLASS_SIZE[c] - 1) for c in range(classes)], dtype=native)
    keeps = np.array(
        [np.frombuffer(bytes(width - s) + b"\x01" * s, dtype=native)[0] for s in range(width + 1)], dtype=native
    )
    return np.dtype(f">u{width}"), heads, keeps


_ROWS = {4: _row_kind(4, np.uint32), 8: _row_kind(8, np.uint64)}


def _as_uint_array(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as an unsigned numpy array (no copy for arrays); ValueError on negatives/non-ints."""
    if isinstance(token_ids, np.ndarray):
        arr = token_ids.ravel()
        if arr.size and arr.dtype.kind not in "iu":
            raise ValueError(f"token_ids: expected integers, got dtype {arr.dtype}")
        if arr.size and arr.dtype.kind == "i" and int(arr.min()) < 0:
            raise ValueError(f"token_ids: negative token id {int(arr.min())}")
        return arr.astype(np.uint64, copy=False)
    try:
        # array('I') converts a list ~2.5x faster than np.asarray(dtype=int64); 32-bit ids only.
        return np.frombuffer(array("I", token_ids), dtype=np.uint32)
    except OverflowError:
        pass
    except TypeError as e:
        raise ValueError(f"token_ids: expected integers ({e})") from e
    try:
        return np.asarray(token_ids, dtype=np.uint64)
    except OverflowError as e:
        raise ValueError("token_ids: ids must be integers in [0, 2**64)") from e


def encode_blocks(token_ids: Sequence[int] | np.ndarray, block_size: int) -> tuple[bytes, list[int]]:
    """CBOR-encode the full blocks of a prompt, each as ``array-head | tokens | null``.

    Block ``i``'s hash input is then ``0x83 | bytes-head | parent | buf[bounds[i]:bounds[i+1]]``,
    byte-identical to ``cbor2.dumps((parent, tuple(block), None), canonical=True)``. Every token
    becomes a big-endian row of 4 bytes (all ids below 2**16) or 8 (ids below 2**32),
    ``value | head << 8 * (size - 1)``, whose last ``size`` bytes are its CBOR encoding (RFC 8949
    §3, shortest form); the array head and the null are rows too, and one boolean compaction
    (``np.compress``; its mask is a table lookup of ``width``-byte patterns viewed as bools)
    concatenates all suffixes. Ids of 2**32 and above (never a real vocabulary) take ``cbor2``.
    Measured with 8k tokens below 2**16, one core: ~0.1 ms from a numpy array, ~0.15 ms from a
    list, against ~0.25 ms with 8-byte rows and an ``unpackbits`` mask (bench/router.py's hash
    column).

    Args:
        token_ids: ints in [0, 2**64); a trailing partial block is ignored.
        block_size: tokens per block.

    Returns:
        ``(buf, bounds)`` with ``len(bounds) == num_full_blocks + 1``.

    Raises:
        ValueError: a token id is negative or not an integer.
    """
    num_blocks = len(token_ids) // block_size
    if num_blocks == 0:
        return b"", [0]
    num_tokens = num_blocks * block_size
    n = _as_uint_array(token_ids if len(token_ids) == num_tokens else token_ids[:num_tokens])
    array_head = _cbor_head(4, block_size)
    top = int(n.max())
    if top >= 0x100000000 or len(array_head) > 8:
        blocks = [
            array_head + b"".join(cbor2.dumps(int(t)) for t in blk) + _NULL
            for blk in n.reshape(num_blocks, block_size).tolist()
        ]
        return b"".join(blocks), [0, *np.cumsum([len(b) for b in blocks]).tolist()]
    width = 4 if top < 0x10000 and len(array_head) <= 4 else 8
    row_dtype, heads, keeps = _ROWS[width]
    row_len = block_size + 2
    if n.dtype != heads.dtype:
        converted = _scratch("n", num_tokens, heads.dtype)
        np.copyto(converted, n, casting="unsafe")  # every id fits: top < 2**32 (or 2**16 for width 4)
        n = converted
    cls = _scratch("cls", num_tokens, np.int8)
    flag = _scratch("flag", num_tokens, np.int8)
    np.greater_equal(n, 24, out=cls.view(bool))
    np.greater_equal(n, 0x100, out=flag.view(bool))
    cls += flag
    if width == 8:
        np.greater_equal(n, 0x10000, out=flag.view(bool))
        cls += flag
    value = _scratch("value", num_tokens, heads.dtype)
    np.take(heads, cls, out=value, mode="clip")
    value |= n
    rows = _scratch("rows", num_blocks * row_len, row_dtype).reshape(num_blocks, row_len)
    rows[:, 0] = int.from_bytes(array_head, "big")
    rows[:, 1:-1] = value.reshape(num_blocks, block_size)
    rows[:, -1] = _NULL[0]
    sizes = _scratch("sizes", num_blocks * row_len, np.int8).reshape(num_blocks, row_len)
    sizes[:, 0] = len(array_head)
    sizes[:, 1:-1] = _CLASS_SIZE.take(cls, mode="clip").reshape(num_blocks, block_size)
    sizes[:, -1] = 1
    keep = _scratch("keep", num_blocks * row_len, keeps.dtype)
    np.take(keeps, sizes.ravel(), out=keep, mode="clip")
    csum = _scratch("csum", num_blocks * row_len, np.int64)
    np.cumsum(sizes.ravel(), dtype=np.int64, out=csum)
    ends = csum[row_len - 1 :: row_len]
    buf = _scratch("buf", int(ends[-1]), np.uint8)
    np.compress(keep.view(bool), rows.view(np.uint8).ravel(), out=buf)
    return buf.tobytes(), [0, *ends.tolist()]


_SCRATCH = threading.local()


def _scratch(name: str, size: int, dtype: np.dtype | type) -> np.ndarray:
    """A 1-D array of ``size`` items of ``dtype``, in a per-thread buffer reused from call to call
    (grown on demand). ``encode_blocks`` writes every temporary into these: fresh temporaries of
    ~10-70 KB each were measured to cost 2.5x (8k tokens: 0.32 vs 0.13 ms) in processes whose heap
    top glibc trims and regrows on every call (any process that imported the protobuf modules)."""
    dtype = np.dtype(dtype)
    need = size * dtype.itemsize
    buf = getattr(_SCRATCH, name, None)
    if buf is None or buf.nbytes < need:
        buf = np.empty(max(need, 2 * (0 if buf is None else buf.nbytes), 64), dtype=np.uint8)
        setattr(_SCRATCH, name, buf)
    return buf[:need].view(dtype)


@dataclass(frozen=True)
class MultiModalItem:
    """A multimodal placeholder in the prompt: ``length`` tokens starting at ``offset``."""

    identifier: str
    offset: int
    length: int


@dataclass(frozen=True)
class BlockHashKeys:
    """What besides the tokens goes into a request's block hashes (the tagged extra keys)."""

    lora: tuple[str, str] | None = None  # (name, path)
    mm_items: tuple[MultiModalItem, ...] = field(default_factory=tuple)
    cache_salt: str | None = None

    def extra_for_block(self, block_idx: int, block_size: int) -> ExtraKeys:
        """The ``extra_i`` of block ``block_idx``: a tuple of tagged keys, or None when empty."""
        keys: list[tuple] = []
        if self.lora is not None:
            keys.append(("lora", self.lora[0], self.lora[1]))
        start, end = block_idx * block_size, (block_idx + 1) * block_size
        for item in self.mm_items:
            if item.offset < end and item.offset + item.length > start:
                keys.append(("mm", item.identifier, item.offset - start))
        if block_idx == 0 and self.cache_salt:
            keys.append(("cache_salt", self.cache_salt))
        return tuple(keys) if keys else None

    @property
    def empty(self) -> bool:
        return self.lora is None and not self.mm_items and not self.cache_salt


NO_KEYS = BlockHashKeys()


class BlockHasher:
    """Computes chained block hashes for one (algorithm, seed, block_size) triple.

    The triple is part of every replica heartbeat; a router refuses replicas whose triple differs
    (``identity``). Digests are ``bytes`` (32 for sha256_cbor, 16 for xxhash_cbor).

    Raises:
        ValueError: unknown algorithm, empty seed or block_size < 1.
    """

    # Prompts of fewer full blocks than this are encoded block by block with cbor2: for a handful of
    # blocks numpy's fixed cost dominates. Measured (one core, per prompt, hot loop / right after a
    # cache flush, as a router between requests): 4 blocks 9 / 31 us with cbor2 against 22 / 103 us
    # with numpy; 16 blocks 35 / 60 against 32 / 130; 64 blocks 140 / 174 against 69 / 186.
    short_prompt_blocks = 16

    def __init__(self, algorithm: str = "sha256_cbor", seed: str = DEFAULT_SEED, block_size: int = DEFAULT_BLOCK_SIZE):
        if algorithm not in _DIGESTS:
            raise ValueError(f"hash_algorithm: unknown {algorithm!r}; expected one of {HASH_ALGORITHMS}")
        if not isinstance(seed, str) or not seed:
            raise ValueError("hash_seed: must be a non-empty string")
        if block_size < 1:
            raise ValueError(f"block_size: must be >= 1, got {block_size}")
        self.algorithm = algorithm
        self.seed = seed
        self.block_size = block_size
        self._digest = _DIGESTS[algorithm]
        self.none_hash: bytes = self._digest(cbor2.dumps(seed, canonical=True))
        # 3-element array head + the byte-string head of a parent digest.
        self._tuple_head = b"\x83" + _cbor_head(2, len(self.none_hash))

    @property
    def seed_digest(self) -> str:
        """Hex of NONE_HASH's first 8 bytes: identifies the seed without revealing it."""
        return self.none_hash[:8].hex()

    @property
    def identity(self) -> tuple[str, str, int]:
        """(algorithm, seed_digest, block_size): equal triples produce equal chains."""
        return (self.algorithm, self.seed_digest, self.block_size)

    def hash_block(self, parent: bytes | None, tokens: Sequence[int], extra: ExtraKeys = None) -> bytes:
        """One block's digest, straight from the definition (``cbor2`` + digest). Not the hot path."""
        parent = self.none_hash if parent is None else parent
        return self._digest(cbor2.dumps((parent, tuple(int(t) for t in tokens), extra), canonical=True))

    def hash_blocks(
        self,
        token_ids: Sequence[int] | np.ndarray,
        keys: BlockHashKeys = NO_KEYS,
        *,
        parent: bytes | None = None,
        start_block: int = 0,
    ) -> list[bytes]:
        """Digests of the full blocks of ``token_ids`` (the fast path).

        Args:
            token_ids: the tokens of blocks ``start_block, start_block + 1, ...``; a trailing
                partial block is ignored. Ints in [0, 2**64).
            keys: the request's extra keys (LoRA, multimodal items, cache_salt).
            parent: digest of block ``start_block - 1``; None means NONE_HASH (requires
                ``start_block == 0``).
            start_block: index of the first block in the request, for the extra keys.

        Returns:
            ``len(token_ids) // block_size`` digests, in chain order.

        Raises:
            ValueError: a negative token id, or ``parent`` missing for ``start_block > 0``.
        """
        B = self.block_size
        num_blocks = len(token_ids) // B
        if num_blocks == 0:
            return []
        if parent is None:
            if start_block != 0:
                raise ValueError("parent: required when start_block > 0")
            parent = self.none_hash
        digest, pre = self._digest, self._tuple_head
        out: list[bytes] = []
        if num_blocks < self.short_prompt_blocks:
            ids = _as_uint_array(token_ids[: num_blocks * B]).tolist()  # validates, as encode_blocks does
            dumps = cbor2.dumps
            for i in range(num_blocks):
                extra = None if keys.empty else keys.extra_for_block(start_block + i, B)
                parent = digest(dumps((parent, tuple(ids[i * B : (i + 1) * B]), extra), canonical=True))
                out.append(parent)
            return out
        buf, bounds = encode_blocks(token_ids, B)
        # The chain as a comprehension carrying the parent (2% faster than a loop with append);
        # sha256 inlined: a Python-level digest wrapper costs ~15% of it.
        if keys.empty and self.algorithm == "sha256_cbor":
            sha256 = hashlib.sha256
            return [(parent := sha256(pre + parent + buf[a:b]).digest()) for a, b in zip(bounds, bounds[1:], strict=False)]
        if keys.empty:
            return [(parent := digest(pre + parent + buf[a:b])) for a, b in zip(bounds, bounds[1:], strict=False)]
        for i, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
            extra = keys.extra_for_block(start_block + i, B)
            tail = _NULL if extra is None else cbor2.dumps(extra, canonical=True)
            parent = digest(pre + parent + buf[a : b - 1] + tail)
            out.append(parent)
        return out

    def event_ints(self, token_ids: Sequence[int] | np.ndarray, keys: BlockHashKeys = NO_KEYS) -> list[int]:
        """The 64-bit keys of the full blocks of a prompt, as the router indexes them."""
        return event_ints_of(self.hash_blocks(token_ids, keys))


def event_ints_of(digests: Sequence[bytes]) -> list[int]:
    """``to_event_int`` of each digest, read in one numpy pass (~5x faster than a loop)."""
    if not digests:
        return []
    words = len(digests[0]) // 8
    return np.frombuffer(b"".join(digests), dtype=">u8")[words - 1 :: words].tolist()


class HashChainMemo:
    """Remembers the block-hash chains of prompts seen before, so that a prompt sharing a prefix
    with an earlier one hashes only what follows it. For the router's hot path: a prefix-aware
    router's traffic is, by design, prompts that share prefixes (system prompts, earlier turns of a
    conversation re-sent in full).

    A trie over blocks: each node maps a block's raw token bytes (the ids as uint32, or uint64 when
    an id needs it) to ``(digest, event int, child node)``; the root is chosen by ``cache_salt``
    (it changes every hash of the chain). A lookup walks the trie with one slice + dict probe per
    block (~0.2 us against ~0.5 us for building the block's CBOR input and its SHA-256) and hashes
    the rest with :meth:`BlockHasher.hash_blocks` from the last known digest, adding it to the trie.
    Results are exactly ``hasher.event_ints(token_ids, keys)`` (tests check it). Requests with LoRA
    or multimodal keys bypass the memo.

    Memory is bounded by ``max_blocks`` remembered blocks (~0.5 KB each: 32 MB for the default):
    past it the whole trie is dropped and rebuilt from the next requests (simple, and cheap next to
    an LRU's bookkeeping per block). ``max_blocks=0`` disables it. Not thread-safe: one owner (the
    router's event loop). Measured in bench/router.py: an 8k-token prompt whose first 511 blocks
    are remembered hashes in ~0.2 ms against ~0.44 ms with every block hashed.

    Args:
        hasher: the hasher whose chains are remembered.
        max_blocks: at most this many blocks remembered.
    """

    def __init__(self, hasher: BlockHasher, max_blocks: int = 65536):
        if max_blocks < 0:
            raise ValueError(f"max_blocks: must be >= 0, got {max_blocks}")
        self.hasher = hasher
        self.max_blocks = max_blocks
        self._roots: dict[str | None, dict] = {}
        self.size = 0  # blocks remembered
        self.hits = 0  # blocks answered from the memo (cumulative)
        self.misses = 0  # blocks hashed (cumulative)

    def clear(self) -> None:
        self._roots.clear()
        self.size = 0

    def event_ints(self, token_ids: Sequence[int] | np.ndarray, keys: BlockHashKeys = NO_KEYS) -> list[int]:
        """``hasher.event_ints(token_ids, keys)``, from the memo where it can.

        Raises:
            ValueError: a token id is negative or not an integer.
        """
        hasher = self.hasher
        if self.max_blocks == 0 or keys.lora is not None or keys.mm_items:
            return hasher.event_ints(token_ids, keys)
        B = hasher.block_size
        num_blocks = len(token_ids) // B
        if num_blocks == 0:
            return []
        ids = _as_uint_array(token_ids[: num_blocks * B])
        if ids.dtype != np.uint32 and (not ids.size or int(ids.max()) < 0x100000000):
            ids = ids.astype(np.uint32)
        raw = ids.tobytes()
        step = B * ids.itemsize
        node = self._roots.get(keys.cache_salt)
        if node is None:
            node = self._roots[keys.cache_salt] = {}
        out: list[int] = []
        parent = None
        i = 0
        get = node.get
        while i < num_blocks:
            entry = get(raw[i * step : (i + 1) * step])
            if entry is None:
                break
            parent, event_int, node = entry
            get = node.get
            out.append(event_int)
            i += 1
        self.hits += i
        if i == num_blocks:
            return out
        digests = hasher.hash_blocks(ids[i * B :], keys, parent=parent, start_block=i)
        ints = event_ints_of(digests)
        self.misses += len(digests)
        if self.size + len(digests) > self.max_blocks:
            self.clear()
            node = self._roots[keys.cache_salt] = {}
            if len(digests) > self.max_blocks or i:
                out.extend(ints)  # the chain's head is gone with the trie: remember nothing of it
                return out
        for k, (digest, event_int) in enumerate(zip(digests, ints, strict=True)):
            child: dict = {}
            a = (i + k) * step
            node[raw[a : a + step]] = (digest, event_int, child)
            node = child
        self.size += len(digests)
        out.extend(ints)
        return out
