"""Block hashing (DESIGN.md §2): the published vectors, and the fast path against a plain reference.

The reference below is written from the definition in DESIGN.md §2 with ``cbor2`` and ``hashlib`` /
``xxhash`` only; it deliberately does not call ``BlockHasher.hash_block`` or
``BlockHashKeys.extra_for_block``, so that a drift in either shows up here.
"""

from __future__ import annotations

import hashlib
import random
import shutil
import struct

import cbor2
import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvroute.hashing import (
    IMPLEMENTATIONS,
    BlockHasher,
    BlockHashKeys,
    MultiModalItem,
    available_implementations,
    encode_blocks,
    to_event_int,
)

# Every path hash_blocks can take here: the compiled chain with libcrypto's SHA-256 or with the
# Python-level digest, numpy, and numpy's short-prompt branch (block by block with cbor2).
PATHS = [*available_implementations("sha256_cbor"), "cbor2"]


def make_hasher(path: str, algorithm: str = "sha256_cbor", seed: str = "vllm-none-hash", block_size: int = 16):
    """A hasher forced onto ``path`` (libcrypto exists for sha256_cbor only: xxhash takes "c")."""
    if path == "libcrypto" and algorithm != "sha256_cbor":
        path = "c"
    hasher = BlockHasher(algorithm, seed, block_size, implementation="numpy" if path == "cbor2" else path)
    hasher.short_prompt_blocks = 10**9 if path == "cbor2" else 0
    return hasher

# -- the reference ------------------------------------------------------------------------------

_REF_DIGEST = {"sha256_cbor": lambda b: hashlib.sha256(b).digest(), "xxhash_cbor": xxhash.xxh3_128_digest}


def ref_extra(block_idx, block_size, lora=None, mm_items=(), cache_salt=None):
    """DESIGN §2: ("lora", name, path) on every block, ("mm", id, offset - block_start) per overlapping
    item, ("cache_salt", salt) on block 0 only, in that order; None when empty."""
    start, end = block_idx * block_size, (block_idx + 1) * block_size
    keys = []
    if lora is not None:
        keys.append(("lora", lora[0], lora[1]))
    for ident, offset, length in mm_items:
        if max(start, offset) < min(end, offset + length):  # [offset, offset+length) meets the block
            keys.append(("mm", ident, offset - start))
    if block_idx == 0 and cache_salt:
        keys.append(("cache_salt", cache_salt))
    return tuple(keys) if keys else None


def ref_hashes(tokens, block_size, seed="vllm-none-hash", algorithm="sha256_cbor", **extra):
    digest = _REF_DIGEST[algorithm]
    parent = digest(cbor2.dumps(seed, canonical=True))
    out = []
    for i in range(len(tokens) // block_size):
        block = tuple(int(t) for t in tokens[i * block_size : (i + 1) * block_size])
        parent = digest(cbor2.dumps((parent, block, ref_extra(i, block_size, **extra)), canonical=True))
        out.append(parent)
    return out


def ref_event_int(digest: bytes) -> int:
    return struct.unpack(">Q", digest[-8:])[0]


# -- DESIGN.md §2 test vectors, verbatim ------------------------------------------------------------


def test_design_vectors_seed_0_block_size_4_tokens_1_to_10():
    hasher = BlockHasher("sha256_cbor", seed="0", block_size=4)
    assert hasher.none_hash.hex().startswith("4e1195df020de59e")
    digests = hasher.hash_blocks(list(range(1, 11)))
    assert len(digests) == 2  # 2 full blocks; tokens 9, 10 are not hashed
    assert digests[0].hex().startswith("c9d58ba695280d69")
    assert to_event_int(digests[0]) == 2164874634404590027
    assert digests[1].hex().startswith("24125b23e68883b5")
    assert to_event_int(digests[1]) == 17270480062156288726
    assert hasher.event_ints(list(range(1, 11))) == [2164874634404590027, 17270480062156288726]


def test_design_vectors_default_seed():
    hasher = BlockHasher(block_size=4)
    assert hasher.seed == "vllm-none-hash"
    assert hasher.none_hash.hex().startswith("9bd96a485ad84efd")
    assert hasher.event_ints(list(range(1, 11))) == [9561501211280363793, 15292913576410714033]


def test_design_vectors_match_the_plain_reference():
    assert ref_hashes(list(range(1, 11)), 4, seed="0") == BlockHasher(seed="0", block_size=4).hash_blocks(
        list(range(1, 11))
    )
    ints = [ref_event_int(d) for d in ref_hashes(list(range(1, 11)), 4)]
    assert ints == [9561501211280363793, 15292913576410714033]


def test_reference_hash_block_equals_fast_path_on_vectors():
    hasher = BlockHasher(seed="0", block_size=4)
    h0 = hasher.hash_block(None, [1, 2, 3, 4])
    h1 = hasher.hash_block(h0, [5, 6, 7, 8])
    assert [h0, h1] == hasher.hash_blocks(list(range(1, 11)))


@pytest.mark.parametrize("path", PATHS)
def test_empty_extra_hashes_as_no_extra_on_the_design_vectors(path):
    # DESIGN.md §2: extra_i is None when empty, so () must give the table's digests, not CBOR [].
    hasher = make_hasher(path, seed="0", block_size=4)
    h0 = hasher.hash_block(None, [1, 2, 3, 4], ())
    h1 = hasher.hash_block(h0, [5, 6, 7, 8], ())
    assert h0[:8].hex() == "c9d58ba695280d69"
    assert h1[:8].hex() == "24125b23e68883b5"
    assert [to_event_int(h0), to_event_int(h1)] == [2164874634404590027, 17270480062156288726]
    assert [h0, h1] == hasher.hash_blocks(list(range(1, 11)), BlockHashKeys(mm_items=()))


def test_event_int_is_last_8_bytes_big_endian():
    digest = bytes(range(32))
    assert to_event_int(digest) == 0x18191A1B1C1D1E1F
    assert to_event_int(b"\x00" * 8 + b"\xff" * 8) == 2**64 - 1


def test_identity_carries_algorithm_seed_digest_and_block_size():
    hasher = BlockHasher("xxhash_cbor", seed="s", block_size=32)
    assert hasher.identity == ("xxhash_cbor", xxhash.xxh3_128_digest(cbor2.dumps("s"))[:8].hex(), 32)
    assert len(hasher.none_hash) == 16
    assert len(BlockHasher().none_hash) == 32


def test_only_full_blocks_are_hashed():
    hasher = BlockHasher(block_size=4)
    assert hasher.hash_blocks([1, 2, 3]) == []
    assert hasher.hash_blocks([]) == []
    assert len(hasher.hash_blocks(list(range(11)))) == 2


# -- tags and errors -----------------------------------------------------------------------------------


def test_tags_keep_lora_named_x_apart_from_salt_x_and_mm_x():
    hasher = BlockHasher(block_size=4)
    tokens = [1, 2, 3, 4]
    lora = hasher.hash_blocks(tokens, BlockHashKeys(lora=("x", "x")))
    salt = hasher.hash_blocks(tokens, BlockHashKeys(cache_salt="x"))
    mm = hasher.hash_blocks(tokens, BlockHashKeys(mm_items=(MultiModalItem("x", 0, 4),)))
    plain = hasher.hash_blocks(tokens)
    assert len({lora[0], salt[0], mm[0], plain[0]}) == 4
    assert salt == ref_hashes(tokens, 4, cache_salt="x")
    assert lora == ref_hashes(tokens, 4, lora=("x", "x"))
    assert mm == ref_hashes(tokens, 4, mm_items=[("x", 0, 4)])


def test_cache_salt_only_changes_block_0_input_but_the_whole_chain():
    hasher = BlockHasher(block_size=2)
    salted = hasher.hash_blocks([1, 2, 3, 4], BlockHashKeys(cache_salt="s"))
    # block 1's own extra is None, but its parent differs
    assert salted[1] == hasher.hash_block(salted[0], [3, 4], None)
    assert salted[0] != hasher.hash_blocks([1, 2])[0]


@pytest.mark.parametrize(
    "tokens",
    [[1, 2, -1, 4], np.array([1, 2, -1, 4], dtype=np.int64), [1, 2, 3, 2**64], [1, 2.5, 3, 4]],
    ids=["negative-list", "negative-numpy", "too-big", "float"],
)
@pytest.mark.parametrize("path", PATHS)
def test_invalid_token_ids_raise_value_error(tokens, path):
    with pytest.raises(ValueError, match="token"):
        make_hasher(path, block_size=4).hash_blocks(tokens)


@pytest.mark.parametrize("path", PATHS)
def test_float_numpy_tokens_raise_value_error(path):
    with pytest.raises(ValueError, match="integers"):
        make_hasher(path, block_size=2).hash_blocks(np.array([1.0, 2.0]))


def test_the_compiled_chain_is_built_where_a_c_compiler_is():
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler: kvroute._hashchain is optional and the numpy path runs")
    assert "c" in available_implementations("xxhash_cbor"), "pip install did not build kvroute._hashchain"
    assert BlockHasher().implementation == available_implementations()[0]


def test_unavailable_or_unknown_implementation_raises():
    with pytest.raises(ValueError, match="implementation"):
        BlockHasher("xxhash_cbor", implementation="libcrypto")
    with pytest.raises(ValueError, match="implementation"):
        BlockHasher(implementation="rust")
    assert set(available_implementations()) <= set(IMPLEMENTATIONS)


@pytest.mark.skipif("c" not in available_implementations(), reason="kvroute._hashchain not built")
def test_compiled_chain_rejects_bad_arguments_with_the_field_named():
    from array import array

    from kvroute import _hashchain

    head, parent = b"\x83\x58\x20", bytes(32)
    sha = _REF_DIGEST["sha256_cbor"]
    with pytest.raises(ValueError, match="ids"):
        _hashchain.chain(array("i", [1, 2]), 2, head, parent, sha)  # signed ints
    with pytest.raises(ValueError, match="block_size"):
        _hashchain.chain(array("I", [1, 2]), 0, head, parent, sha)
    with pytest.raises(ValueError, match="tails"):
        _hashchain.chain(array("I", [1, 2, 3, 4]), 2, head, parent, sha, [b"\xf6"])
    with pytest.raises(TypeError, match="tails"):
        _hashchain.chain(array("I", [1, 2]), 2, head, parent, sha, ["x"])
    with pytest.raises(ValueError, match="digest"):
        _hashchain.chain(array("I", [1, 2]), 2, head, parent, lambda b: b"short")
    with pytest.raises(TypeError, match="digest"):
        _hashchain.chain(array("I", [1, 2]), 2, head, parent, 3)
    with pytest.raises(ZeroDivisionError):  # the digest's own error passes through
        _hashchain.chain(array("I", [1, 2]), 2, head, parent, lambda b: 1 / 0)
    assert _hashchain.chain(array("I", [1, 2, 3]), 2, head, parent, sha) == [
        sha(cbor2.dumps((parent, (1, 2), None), canonical=True))
    ]


def test_parent_required_when_start_block_positive():
    with pytest.raises(ValueError, match="parent"):
        BlockHasher(block_size=2).hash_blocks([1, 2], start_block=1)


@pytest.mark.parametrize(
    "kwargs", [{"algorithm": "md5"}, {"seed": ""}, {"block_size": 0}], ids=["algorithm", "seed", "block_size"]
)
def test_bad_hasher_arguments_raise(kwargs):
    with pytest.raises(ValueError):
        BlockHasher(**kwargs)


# -- the fast path against the reference (hypothesis) -----------------------------------------------

# CBOR size-class boundaries (RFC 8949 §3): 1, 2, 3, 5, 9 bytes.
_BOUNDARIES = [0, 1, 23, 24, 255, 256, 65535, 65536, 2**31 - 1, 2**31]
_BIG_BOUNDARIES = [2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1]


def _tokens(rng: random.Random, n: int, big: bool, small: bool = False) -> list[int]:
    """Ids around every CBOR size boundary; ``small``: all below 2**16 (the 4-byte-row path)."""
    hi = 2**64 - 1 if big else 2**31
    picks = _BOUNDARIES + (_BIG_BOUNDARIES if big else [])
    if small:
        hi, picks = 2**16 - 1, [b for b in _BOUNDARIES if b < 2**16]
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.15:
            out.append(rng.choice(picks))
        elif r < 0.4:
            out.append(rng.randrange(0, 300))
        elif r < 0.6:
            out.append(rng.randrange(0, min(70000, hi + 1)))
        else:
            out.append(rng.randint(0, hi))
    return out


@st.composite
def prompts(draw):
    block_size = draw(st.one_of(st.integers(1, 24), st.integers(1, 300)))
    num_blocks = draw(st.integers(0, max(1, min(6, 1200 // block_size))))
    partial = draw(st.integers(0, block_size - 1))
    kind = draw(st.integers(0, 3))
    big = kind == 0  # ids up to 2**64 - 1 in a quarter of the prompts
    small = kind == 1  # all ids below 2**16 in another quarter
    rng = random.Random(draw(st.integers(0, 2**32)))
    tokens = _tokens(rng, num_blocks * block_size + partial, big, small)
    return block_size, tokens, big


@st.composite
def hash_keys(draw, num_tokens):
    text = st.text(max_size=12)
    lora = draw(st.none() | st.tuples(text, text))
    mm = []
    if num_tokens:
        for _ in range(draw(st.integers(0, 3))):
            offset = draw(st.integers(0, num_tokens - 1))
            length = draw(st.integers(1, num_tokens - offset))
            mm.append((draw(text), offset, length))
    salt = draw(st.none() | st.text(min_size=1, max_size=12))
    return {"lora": lora, "mm_items": mm, "cache_salt": salt}


def _keys(spec) -> BlockHashKeys:
    return BlockHashKeys(
        lora=spec["lora"],
        mm_items=tuple(MultiModalItem(i, o, n) for i, o, n in spec["mm_items"]),
        cache_salt=spec["cache_salt"],
    )


_SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_SETTINGS
@given(
    prompt=prompts(),
    algorithm=st.sampled_from(["sha256_cbor", "xxhash_cbor"]),
    seed=st.text(min_size=1, max_size=20),
    container=st.sampled_from(["list", "tuple", "numpy", "list of numpy ints"]),
    path=st.sampled_from(PATHS),
    data=st.data(),
)
def test_fast_path_equals_plain_cbor_reference(prompt, algorithm, seed, container, path, data):
    block_size, tokens, big = prompt
    spec = data.draw(st.none() | hash_keys(len(tokens)))
    hasher = make_hasher(path, algorithm, seed, block_size)
    expected = ref_hashes(tokens, block_size, seed, algorithm, **(spec or {}))
    arg = {
        "list": tokens,
        "tuple": tuple(tokens),
        "numpy": np.array(tokens, dtype=np.uint64),
        "list of numpy ints": list(np.array(tokens, dtype=np.uint64)),
    }[container]
    got = hasher.hash_blocks(arg, _keys(spec)) if spec else hasher.hash_blocks(arg)
    assert got == expected
    assert (hasher.event_ints(arg, _keys(spec)) if spec else hasher.event_ints(arg)) == [
        ref_event_int(d) for d in expected
    ]


@_SETTINGS
@given(prompt=prompts(), data=st.data())
def test_hashing_in_two_pieces_equals_hashing_whole(prompt, data):
    block_size, tokens, _ = prompt
    spec = data.draw(st.none() | hash_keys(len(tokens)))
    keys = _keys(spec) if spec else BlockHashKeys()
    path = data.draw(st.sampled_from(PATHS))
    hasher = make_hasher(path, data.draw(st.sampled_from(["sha256_cbor", "xxhash_cbor"])), block_size=block_size)
    if path == "numpy":
        hasher.short_prompt_blocks = data.draw(st.sampled_from([0, 3]))
    whole = hasher.hash_blocks(tokens, keys)
    split = data.draw(st.integers(0, len(whole)))
    first = hasher.hash_blocks(tokens[: split * block_size], keys)
    rest = hasher.hash_blocks(
        tokens[split * block_size :], keys, parent=first[-1] if first else None, start_block=split
    )
    assert first + rest == whole


@_SETTINGS
@given(prompt=prompts(), parent=st.binary(min_size=32, max_size=32))
def test_encode_blocks_bytes_equal_cbor2_tuple_encoding(prompt, parent):
    block_size, tokens, _ = prompt
    buf, bounds = encode_blocks(tokens, block_size)
    assert len(bounds) == len(tokens) // block_size + 1
    head = b"\x83\x58\x20"  # 3-element array, 32-byte byte string
    for i in range(len(bounds) - 1):
        block = tuple(tokens[i * block_size : (i + 1) * block_size])
        assert head + parent + buf[bounds[i] : bounds[i + 1]] == cbor2.dumps(
            (parent, block, None), canonical=True
        )


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64])
def test_numpy_dtypes_hash_like_lists(dtype, path):
    tokens = [0, 23, 24, 255, 256, 65535, 65536, 2**31 - 1] * 5
    tokens = [t for t in tokens if t <= np.iinfo(dtype).max] * 2
    hasher = make_hasher(path, block_size=8)
    assert hasher.hash_blocks(np.array(tokens, dtype=dtype)) == ref_hashes(tokens, 8)
