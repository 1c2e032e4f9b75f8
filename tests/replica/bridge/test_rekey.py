"""Re-keying vLLM's events into kvroute's (replica.bridge.rekey): on the captured vLLM stream the
re-keyed hashes are the ones the router computes for the same prompts, and the re-keyed index
predicts exactly the cached_tokens vLLM reported."""

from __future__ import annotations

from collections import Counter

import pytest

from kvroute.events import GPU, AllBlocksCleared, BlockRemoved, BlockStored
from kvroute.hashing import BlockHasher, BlockHashKeys, MultiModalItem
from kvroute.ordering import ReplicaCacheState
from replica.bridge.rekey import Rekeyer, RekeyRefusedError
from replica.bridge.vllm_events import VllmAllBlocksCleared, VllmBlockRemoved, VllmBlockStored, decode_message
from tests.replica.bridge.captures import VARIANTS, Capture, load

B = 32
# vLLM's own chain, another seed, another algorithm: the re-keyed hashes follow kvroute's settings.
HASHERS = [("sha256_cbor", "vllm-none-hash"), ("sha256_cbor", "kvroute-test"), ("xxhash_cbor", "x")]


def keys_of(request: dict) -> BlockHashKeys:
    return BlockHashKeys(cache_salt=request.get("cache_salt"))


def rekeyed(cap: Capture, rekeyer: Rekeyer, start: int = 0, stop: int | None = None) -> list[list]:
    return [rekeyer.translate(decode_message(f).events) for f in cap.live[start:stop]]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(("algorithm", "seed"), HASHERS)
def test_stored_blocks_get_the_hashes_kvroute_computes_for_the_prompt(variant, algorithm, seed):
    cap = load(variant)
    hasher = BlockHasher(algorithm, seed, B)
    out = rekeyed(cap, Rekeyer(hasher))
    for req in cap.requests:
        expected = hasher.event_ints(req["prompt_token_ids"], keys_of(req))
        start = cap.frames_before(req["name"])
        stored = [e for batch in out[start:req["live_frames"]] for e in batch if isinstance(e, BlockStored)]
        if req["name"] in ("b",):
            assert [e.block_hashes for e in stored] == [tuple(expected[3:])]
            assert stored[0].parent_block_hash == expected[2]
        elif req["name"] == "a_again":
            assert stored == []
        else:
            assert [e.block_hashes for e in stored] == [tuple(expected)], req["name"]
            assert stored[0].parent_block_hash is None
            assert stored[0].token_ids == tuple(req["prompt_token_ids"][: 4 * B]) and stored[0].medium == GPU
    salted = next(e for e in out[-1] if isinstance(e, BlockStored))
    assert salted.extra_keys == ((("cache_salt", "salt-1"),), None, None, None)


def test_with_vllms_seed_and_algorithm_the_kvroute_hashes_are_vllms_own():
    cap = load("int")
    out = rekeyed(cap, Rekeyer(BlockHasher("sha256_cbor", "vllm-none-hash", B)))
    for frames, translated in zip(cap.live, out, strict=True):
        ours = [h for e in translated if isinstance(e, BlockStored | BlockRemoved) for h in e.block_hashes]
        theirs = [h for e in decode_message(frames).events if not isinstance(e, VllmAllBlocksCleared)
                  for h in e.block_hashes]
        assert ours == theirs


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(("algorithm", "seed"), HASHERS)
def test_the_rekeyed_index_predicts_vllms_cached_tokens(variant, algorithm, seed):
    """Before each call, the longest prefix of the prompt's kvroute hashes in the re-keyed state
    (at most (prompt tokens - 1) // block_size blocks: vLLM computes the last token) times the block
    size is the cached_tokens vLLM reported for that call."""
    cap = load(variant)
    hasher = BlockHasher(algorithm, seed, B)
    rekeyer, state = Rekeyer(hasher), ReplicaCacheState()
    applied = 0
    for req in cap.requests:
        for batch in rekeyed(cap, rekeyer, applied, cap.frames_before(req["name"])):
            state.apply_events(batch)
        applied = cap.frames_before(req["name"])
        cached = state.as_multiset()[GPU]
        tokens = req["prompt_token_ids"]
        hits = 0
        for h in hasher.event_ints(tokens, keys_of(req))[: (len(tokens) - 1) // B]:
            if cached[h] == 0:
                break
            hits += 1
        assert hits * B == req["usage"]["prompt_tokens_details"]["cached_tokens"], req["name"]
    assert [r["usage"]["prompt_tokens_details"]["cached_tokens"] for r in cap.requests[:3]] == [0, 96, 128]


@pytest.mark.parametrize("variant", VARIANTS)
def test_removals_map_back_and_the_end_state_is_what_followed_the_reset(variant):
    cap = load(variant)
    hasher = BlockHasher("sha256_cbor", "kvroute-test", B)
    rekeyer, state = Rekeyer(hasher), ReplicaCacheState()
    for batch in rekeyed(cap, rekeyer):
        state.apply_events(batch)
    a = cap.request("after_reset")["prompt_token_ids"]
    assert state.as_multiset()[GPU] == Counter(hasher.event_ints(a) + hasher.event_ints(a, keys_of(cap.request("salted"))))
    assert state.num_missing_removals == 0
    assert rekeyer.stats.blocks_removed >= 4 and rekeyer.stats.unknown_removals == 0 and rekeyer.stats.clears == 1
    assert len(rekeyer) == 8


def test_a_bridge_that_joins_mid_stream_skips_what_it_cannot_key():
    """From seq 1 on: b's block chains on a's (never seen): dropped; the evictions of a's blocks
    are removals of hashes never announced: counted and dropped, never phantom."""
    cap = load("int")
    rekeyer = Rekeyer(BlockHasher(block_size=B))
    state = ReplicaCacheState()
    for batch in rekeyed(cap, rekeyer, start=1):
        state.apply_events(batch)
    assert rekeyer.stats.unknown_parent_blocks == 1
    assert rekeyer.stats.unknown_removals >= 1 and state.num_missing_removals == 0


# -- hand-made events -------------------------------------------------------------------------------
TOKENS = tuple(range(1, 9))


def stored(hashes, parent=None, tokens=TOKENS, block_size=4, **kw) -> VllmBlockStored:
    return VllmBlockStored(tuple(hashes), parent, tuple(tokens), block_size, **kw)


@pytest.fixture
def hasher() -> BlockHasher:
    return BlockHasher("sha256_cbor", "0", 4)


def test_design_doc_vectors_come_out_of_a_rekeyed_store(hasher):
    """DESIGN.md §2's vectors (block_size 4, seed "0", tokens 1..8), whatever vLLM named the blocks."""
    (ev,) = Rekeyer(hasher).translate([stored([111, 222])])
    assert ev == BlockStored((2164874634404590027, 17270480062156288726), None, TOKENS, 4, medium=GPU)


def test_a_store_chained_on_a_known_parent_continues_kvroutes_chain(hasher):
    r = Rekeyer(hasher)
    r.translate([stored([111], tokens=TOKENS[:4])])
    (ev,) = r.translate([stored([222], parent=111, tokens=TOKENS[4:])])
    assert ev.block_hashes == (17270480062156288726,) and ev.parent_block_hash == 2164874634404590027


def test_copies_are_counted_per_medium(hasher):
    r = Rekeyer(hasher)
    r.translate([stored([111, 222]), stored([111, 222]), stored([111, 222], medium="CPU")])
    assert r.translate([VllmBlockRemoved((111,), "GPU")]) == [BlockRemoved((2164874634404590027,), GPU)]
    assert r.translate([VllmBlockRemoved((111,), "GPU")]) == [BlockRemoved((2164874634404590027,), GPU)]
    assert r.translate([VllmBlockRemoved((111,), "GPU")]) == [] and r.stats.unknown_removals == 1
    assert r.translate([VllmBlockRemoved((111,), "CPU")]) == [BlockRemoved((2164874634404590027,), "CPU")]
    assert len(r) == 1  # 222 still cached


def test_unknown_removals_and_unknown_parents_are_counted_and_skipped(hasher):
    r = Rekeyer(hasher)
    assert r.translate([VllmBlockRemoved((5, 6))]) == []
    assert r.translate([stored([7, 8], parent=99)]) == []
    assert (r.stats.unknown_removals, r.stats.unknown_parent_blocks, len(r)) == (2, 2, 0)


def test_all_blocks_cleared_forgets_every_block(hasher):
    r = Rekeyer(hasher)
    out = r.translate([stored([111, 222]), VllmAllBlocksCleared(), VllmBlockRemoved((111,))])
    assert out[1:] == [AllBlocksCleared(None)] and len(r) == 0 and r.stats.unknown_removals == 1


def test_a_vllm_hash_seen_with_other_content_drops_the_rest_of_the_run(hasher):
    r = Rekeyer(hasher)
    r.translate([stored([111, 222])])
    (ev,) = r.translate([stored([333, 222], tokens=(1, 2, 3, 4, 9, 9, 9, 9))])
    assert ev.block_hashes == (2164874634404590027,) and ev.token_ids == (1, 2, 3, 4)
    assert r.stats.conflicting_blocks == 1


def test_multimodal_and_salt_keys_become_kvroutes_tagged_keys(hasher):
    keys = BlockHashKeys(mm_items=(MultiModalItem("img", 2, 4),), cache_salt="s")
    (ev,) = Rekeyer(hasher).translate([stored([1, 2], extra_keys=((("img", 2), "s"), (("img", -2),)))])
    assert ev.block_hashes == tuple(hasher.event_ints(TOKENS, keys))
    assert ev.extra_keys == ((("mm", "img", 2), ("cache_salt", "s")), (("mm", "img", -2),))


@pytest.mark.parametrize(("event", "field", "words"), [
    (stored([1, 2], block_size=2, tokens=TOKENS[:4]), "block_size", ["2", "4"]),
    (stored([1]), "token_ids", ["8 tokens", "1 blocks"]),
    (stored([1, 2], lora_name="ad", lora_id=1), "lora_name", ["'ad'"]),
    (stored([1, 2], lora_id=3), "lora_name", ["3"]),
    (stored([1, 2], group_idx=1), "group_idx", ["1"]),
    (stored([1, 2], extra_keys=((b"\x00" * 32,), None)), "extra_keys[0][0]", ["prompt embeddings"]),
    (stored([1, 2], extra_keys=(None, (3.5,))), "extra_keys[1][0]", ["3.5"]),
    (VllmBlockRemoved((1,), group_idx=2), "group_idx", ["2"]),
])
def test_what_kvroute_cannot_key_is_refused_naming_the_field(hasher, event, field, words):
    with pytest.raises(RekeyRefusedError) as err:
        Rekeyer(hasher).translate([event])
    assert err.value.field == field and str(err.value).startswith(f"{field}: ")
    assert all(w in str(err.value) for w in words), str(err.value)
