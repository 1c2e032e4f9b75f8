"""Reference block hashes for the KV cache tests, written from DESIGN.md §2 with ``cbor2`` and
``hashlib`` only (never ``kvroute.hashing``, so that a drift there shows up): sha256_cbor with the
default seed.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import cbor2

NONE_HASH = hashlib.sha256(cbor2.dumps("vllm-none-hash", canonical=True)).digest()


def ref_digest(parent: bytes, tokens: Sequence[int], extra: tuple | None = None) -> bytes:
    """One block's digest: ``sha256(cbor(parent, tuple(tokens), extra))``."""
    return hashlib.sha256(cbor2.dumps((parent, tuple(tokens), extra), canonical=True)).digest()


def ref_chain(tokens: Sequence[int], block_size: int) -> list[bytes]:
    """Digests of the full blocks of ``tokens`` (no extra keys), in chain order."""
    parent, out = NONE_HASH, []
    for i in range(len(tokens) // block_size):
        parent = ref_digest(parent, tokens[i * block_size : (i + 1) * block_size])
        out.append(parent)
    return out


def event_int(digest: bytes) -> int:
    """The event value of a digest: its last 8 bytes, big-endian unsigned."""
    return struct.unpack(">Q", digest[-8:])[0]


def ref_event_ints(tokens: Sequence[int], block_size: int) -> list[int]:
    """``event_int`` of each digest of ``ref_chain(tokens, block_size)``."""
    return [event_int(d) for d in ref_chain(tokens, block_size)]
