"""Chained block hashing: the contract router and replicas must never drift on (DESIGN.md §2).

Only full blocks of ``block_size`` tokens are hashed::

    h_-1 = NONE_HASH = H(CBOR_canonical(seed))
    h_i  = H(CBOR_canonical((h_{i-1}, tuple(tokens[i*B:(i+1)*B]), extra_i)))

with ``H`` SHA-256 (``sha256_cbor``, vLLM's default) or XXH3-128 (``xxhash_cbor``). ``extra_i`` is a
tuple of tagged keys or ``None``: ``("lora", name, path)`` on every block of a LoRA request,
``("mm", identifier, offset - block_start)`` per multimodal item overlapping the block, and
``("cache_salt", salt)`` on block 0 only, in that order. The chain carries full digests; the index
key and event value is the digest's last 8 bytes as a big-endian unsigned 64-bit int.

Fast paths, all producing the bytes of ``cbor2.dumps((parent, tokens, extra), canonical=True)``
(tests check each against a plain cbor2 + hashlib loop with hypothesis; bench/kv_manager.py times
them), best first:

- ``libcrypto``: the compiled chain (``kvroute/_hashchain.c``, built by ``pip install``) encodes each
  block into one reused buffer and digests it with OpenSSL's SHA-256, the libcrypto CPython's
  hashlib already loaded (sha256_cbor only).
- ``c``: the same compiled chain calling the Python-level digest (xxhash's XXH3-128, or hashlib's
  SHA-256 when libcrypto's SHA256_* symbols cannot be found).
- ``numpy``: no compiler at install time (``kvroute/_hashing_numpy.py``). The CBOR encoding of every
  token of the prompt is produced in one vectorised numpy pass, and each block's input is assembled
  as ``0x83 | bytes-header | parent | array-header | token bytes | extra`` for hashlib / xxhash.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import cbor2
import numpy as np
import xxhash

from kvroute._hashing_numpy import NULL as _NULL
from kvroute._hashing_numpy import as_uint_array as _as_uint_array
from kvroute._hashing_numpy import cbor2_chain, encode_blocks, numpy_chain
from kvroute._hashing_numpy import cbor_head as _cbor_head

try:
    from kvroute import _hashchain
except ImportError:  # built without a C compiler: the numpy path
    _hashchain = None

HashAlgorithm = Literal["sha256_cbor", "xxhash_cbor"]
HASH_ALGORITHMS: tuple[str, ...] = ("sha256_cbor", "xxhash_cbor")
DEFAULT_SEED = "vllm-none-hash"
DEFAULT_BLOCK_SIZE = 16

ExtraKeys = tuple[tuple, ...] | None  # the extra of one block, as hashed


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


_DIGESTS = {"sha256_cbor": _sha256, "xxhash_cbor": xxhash.xxh3_128_digest}
IMPLEMENTATIONS: tuple[str, ...] = ("libcrypto", "c", "numpy")


def _load_libcrypto() -> bool:
    """Point the compiled chain at the libcrypto that hashlib loaded (its path from /proc/self/maps),
    else at the usual sonames. True when SHA256_Init/Update/Final were found and pass the FIPS
    180-2 vector (checked in C)."""
    if _hashchain is None:
        return False
    import _hashlib  # noqa: F401  (loads libcrypto into the process)

    candidates: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            candidates = [line.split()[-1] for line in maps if "libcrypto" in line]
    except OSError:
        pass
    candidates += ["libcrypto.so.3", "libcrypto.so.1.1"]
    return any(_hashchain.load_sha256(path) for path in dict.fromkeys(candidates))


_HAVE_LIBCRYPTO = _load_libcrypto()


def available_implementations(algorithm: str = "sha256_cbor") -> list[str]:
    """The fast paths this install can run for ``algorithm``, best first (see the module doc)."""
    out = ["libcrypto"] if algorithm == "sha256_cbor" and _HAVE_LIBCRYPTO else []
    return [*out, *(["c"] if _hashchain is not None else []), "numpy"]


def to_event_int(digest: bytes) -> int:
    """The 64-bit index key / event value of a block digest: its last 8 bytes, big-endian, unsigned."""
    return int.from_bytes(digest[-8:], "big")


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

    Args:
        algorithm: ``"sha256_cbor"`` or ``"xxhash_cbor"``.
        seed: the NONE_HASH seed string.
        block_size: tokens per block.
        implementation: one of :data:`IMPLEMENTATIONS` (same bytes, different speed); None picks the
            best this install has (``available_implementations``).

    Raises:
        ValueError: unknown algorithm, empty seed, block_size < 1, or an implementation this install
            lacks.
    """

    # Prompts of fewer full blocks than this are encoded block by block with cbor2: for a handful of
    # blocks numpy's fixed cost dominates (with a cold cache, as a router between requests, up to
    # about this many blocks).
    short_prompt_blocks = 16

    def __init__(
        self,
        algorithm: str = "sha256_cbor",
        seed: str = DEFAULT_SEED,
        block_size: int = DEFAULT_BLOCK_SIZE,
        implementation: str | None = None,
    ):
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
        available = available_implementations(algorithm)
        if implementation is not None and implementation not in available:
            raise ValueError(f"implementation: {implementation!r} is not available here; expected one of {available}")
        self.implementation: str = implementation or available[0]
        # What the compiled chain digests with: None = libcrypto's SHA-256 inside the C loop.
        self._chain_digest = None if self.implementation == "libcrypto" else self._digest
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
        """One block's digest, straight from the definition (``cbor2`` + digest). Not the hot path.

        An empty ``extra`` (``()``) is no extra: it hashes as None (CBOR null), as every chain path does.
        """
        parent = self.none_hash if parent is None else parent
        extra = extra or None
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
        if self.implementation != "numpy":
            return self._chain(token_ids, keys, parent, start_block, event_ints=False)
        if num_blocks < self.short_prompt_blocks:
            return cbor2_chain(token_ids, B, keys, parent, start_block, self._digest)
        sha256 = self.algorithm == "sha256_cbor"
        return numpy_chain(token_ids, B, keys, parent, start_block, self._digest, self._tuple_head, sha256=sha256)

    def _chain(
        self, token_ids: Sequence[int] | np.ndarray, keys: BlockHashKeys, parent: bytes, start_block: int, event_ints: bool
    ) -> list:
        """The compiled chain (``kvroute/_hashchain.c``): digests, or their event ints."""
        if isinstance(token_ids, np.ndarray):  # a native unsigned buffer as is, else validated to uint64
            ids = np.ascontiguousarray(token_ids.ravel())
            ids = ids if ids.dtype.kind == "u" and ids.dtype.isnative else _as_uint_array(ids)
        else:  # the C code reads lists and tuples itself, validating every id
            ids = token_ids if type(token_ids) in (list, tuple) else list(token_ids)
        tails = None if keys.empty else self._tails(keys, start_block, len(token_ids) // self.block_size)
        return _hashchain.chain(ids, self.block_size, self._tuple_head, parent, self._chain_digest, tails, event_ints)

    def _tails(self, keys: BlockHashKeys, start_block: int, num_blocks: int) -> list[bytes]:
        """Per block, the canonical CBOR of its extra keys (``_NULL`` for None)."""
        B, dumps = self.block_size, cbor2.dumps
        if keys.lora is None and not keys.mm_items:  # only cache_salt, on block 0
            tails = [_NULL] * num_blocks
            if start_block == 0:
                tails[0] = dumps(keys.extra_for_block(0, B), canonical=True)
            return tails
        extras = (keys.extra_for_block(start_block + i, B) for i in range(num_blocks))
        return [_NULL if e is None else dumps(e, canonical=True) for e in extras]

    def event_ints(self, token_ids: Sequence[int] | np.ndarray, keys: BlockHashKeys = NO_KEYS) -> list[int]:
        """The 64-bit keys of the full blocks of a prompt, as the router indexes them.

        Raises:
            ValueError: a token id is negative or not an integer.
        """
        if self.implementation != "numpy" and len(token_ids) >= self.block_size:
            return self._chain(token_ids, keys, self.none_hash, 0, event_ints=True)
        return event_ints_of(self.hash_blocks(token_ids, keys))


def event_ints_of(digests: Sequence[bytes]) -> list[int]:
    """``to_event_int`` of each digest, read in one numpy pass (faster than a loop)."""
    if not digests:
        return []
    words = len(digests[0]) // 8
    return np.frombuffer(b"".join(digests), dtype=">u8")[words - 1 :: words].tolist()



__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_SEED",
    "HASH_ALGORITHMS",
    "IMPLEMENTATIONS",
    "NO_KEYS",
    "BlockHashKeys",
    "BlockHasher",
    "ExtraKeys",
    "HashAlgorithm",
    "MultiModalItem",
    "available_implementations",
    "encode_blocks",
    "event_ints_of",
    "to_event_int",
]
