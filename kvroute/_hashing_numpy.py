"""The numpy fallback of block hashing (``BlockHasher(implementation="numpy")``), the path an
install without a C compiler takes: the CBOR encoding of every token of a prompt in one vectorised
pass (``encode_blocks``), then the chain over ``0x83 | bytes-head | parent | block bytes`` with
hashlib / xxhash; prompts of few blocks go block by block through ``cbor2`` instead.

Every function here produces the bytes of ``cbor2.dumps((parent, tokens, extra), canonical=True)``
(DESIGN.md §2; tests/kvroute/test_hashing.py checks it). ``kvroute.hashing`` is the public face;
this module imports nothing of kvroute.
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections.abc import Callable, Sequence
from typing import Any

import cbor2
import numpy as np

Digest = Callable[[bytes], bytes]


def cbor_head(major: int, n: int) -> bytes:
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
NULL = b"\xf6"  # CBOR null: the extra of a block without extra keys


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


def as_uint_array(token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """Token ids as an unsigned numpy array (no copy for arrays); ValueError on negatives/non-ints."""
    if isinstance(token_ids, np.ndarray):
        arr = token_ids.ravel()
        if arr.size and arr.dtype.kind not in "iu":
            raise ValueError(f"token_ids: expected integers, got dtype {arr.dtype}")
        if arr.size and arr.dtype.kind == "i" and int(arr.min()) < 0:
            raise ValueError(f"token_ids: negative token id {int(arr.min())}")
        return arr.astype(np.uint64, copy=False)
    try:
        # array('I') converts a list faster than np.asarray(dtype=int64); 32-bit ids only.
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

    Args:
        token_ids: ints in [0, 2**64); a trailing partial block is ignored.
        block_size: tokens per block.

    Returns:
        ``(buf, bounds)`` with ``len(bounds) == num_full_blocks + 1``.

    Raises:
        ValueError: a token id is negative or not an integer.
    """
    # Narrow rows sized to the largest id beat 8-byte rows with an ``unpackbits`` mask.
    num_blocks = len(token_ids) // block_size
    if num_blocks == 0:
        return b"", [0]
    num_tokens = num_blocks * block_size
    n = as_uint_array(token_ids if len(token_ids) == num_tokens else token_ids[:num_tokens])
    array_head = cbor_head(4, block_size)
    top = int(n.max())
    if top >= 0x100000000 or len(array_head) > 8:
        blocks = [
            array_head + b"".join(cbor2.dumps(int(t)) for t in blk) + NULL
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
    rows[:, -1] = NULL[0]
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
    tens of KB each cost more than the encoding in processes whose heap top glibc trims and regrows
    on every call (any process that imported the protobuf modules)."""
    dtype = np.dtype(dtype)
    need = size * dtype.itemsize
    buf = getattr(_SCRATCH, name, None)
    if buf is None or buf.nbytes < need:
        buf = np.empty(max(need, 2 * (0 if buf is None else buf.nbytes), 64), dtype=np.uint8)
        setattr(_SCRATCH, name, buf)
    return buf[:need].view(dtype)


def cbor2_chain(
    token_ids: Sequence[int] | np.ndarray, block_size: int, keys: Any, parent: bytes, start_block: int, digest: Digest
) -> list[bytes]:
    """The chain block by block with ``cbor2`` (short prompts): digests of the full blocks of
    ``token_ids``, ``parent`` being the digest before the first; ``keys`` a ``BlockHashKeys``.

    Raises:
        ValueError: a token id is negative or not an integer.
    """
    B = block_size
    num_blocks = len(token_ids) // B
    ids = as_uint_array(token_ids[: num_blocks * B]).tolist()  # validates, as encode_blocks does
    dumps = cbor2.dumps
    out: list[bytes] = []
    for i in range(num_blocks):
        extra = None if keys.empty else keys.extra_for_block(start_block + i, B)
        parent = digest(dumps((parent, tuple(ids[i * B : (i + 1) * B]), extra), canonical=True))
        out.append(parent)
    return out


def numpy_chain(
    token_ids: Sequence[int] | np.ndarray,
    block_size: int,
    keys: Any,
    parent: bytes,
    start_block: int,
    digest: Digest,
    tuple_head: bytes,
    *,
    sha256: bool,
) -> list[bytes]:
    """The chain over ``encode_blocks``' buffer: digests of the full blocks of ``token_ids``.
    ``tuple_head`` is the 3-element array head + the byte-string head of a parent digest;
    ``sha256`` says ``digest`` is SHA-256 (then hashlib's is called inline).

    Raises:
        ValueError: a token id is negative or not an integer.
    """
    buf, bounds = encode_blocks(token_ids, block_size)
    pre = tuple_head
    # The chain as a comprehension carrying the parent (faster than a loop with append);
    # sha256 inlined: a Python-level digest wrapper would cost a visible share of it.
    if keys.empty and sha256:
        sha = hashlib.sha256
        return [(parent := sha(pre + parent + buf[a:b]).digest()) for a, b in zip(bounds, bounds[1:], strict=False)]
    if keys.empty:
        return [(parent := digest(pre + parent + buf[a:b])) for a, b in zip(bounds, bounds[1:], strict=False)]
    out: list[bytes] = []
    for i, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False)):
        extra = keys.extra_for_block(start_block + i, block_size)
        tail = NULL if extra is None else cbor2.dumps(extra, canonical=True)
        parent = digest(pre + parent + buf[a : b - 1] + tail)
        out.append(parent)
    return out
