"""Decoding vLLM's ZMQ KV events (replica.bridge.vllm_events), against messages captured from a real
vLLM 0.32.0 server (tests/data/vllm_events) and against hand-made malformed ones."""

from __future__ import annotations

import contextlib
import hashlib

import cbor2
import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replica.bridge.vllm_events import (
    VllmAllBlocksCleared,
    VllmBatch,
    VllmBlockRemoved,
    VllmBlockStored,
    VllmEventDecodeError,
    decode_event,
    decode_message,
    decode_payload,
    decode_replay_reply,
    replay_request,
)
from tests.replica.bridge.captures import VARIANTS, load

B = 32


def sha256_cbor_chain(tokens: list[int], extras: list | None = None) -> list[bytes]:
    """vLLM's sha256_cbor block digests of the full blocks of ``tokens``, from the definition:
    sha256(CBOR((parent, tuple(block), extra))) with parent 0 = sha256(CBOR("vllm-none-hash"))."""
    parent = hashlib.sha256(cbor2.dumps("vllm-none-hash", canonical=True)).digest()
    out = []
    for i in range(len(tokens) // B):
        extra = extras[i] if extras else None
        parent = hashlib.sha256(cbor2.dumps((parent, tuple(tokens[i * B:(i + 1) * B]), extra), canonical=True)).digest()
        out.append(parent)
    return out


def as_published(digests: list[bytes], variant: str) -> list:
    return [int.from_bytes(d[-8:], "big") for d in digests] if variant == "int" else digests


def batches(variant: str) -> list[VllmBatch]:
    return [decode_message(frames) for frames in load(variant).live]


def stores_of(batch: VllmBatch) -> list[VllmBlockStored]:
    return [e for e in batch.events if isinstance(e, VllmBlockStored)]


@pytest.mark.parametrize("variant", VARIANTS)
def test_captured_messages_decode_with_seqs_from_zero_topic_and_rank(variant):
    cap = load(variant)
    got = batches(variant)
    assert [b.seq for b in got] == list(range(len(cap.live)))
    assert {frames[0] for frames in cap.live} == {b"kv"}
    assert {b.dp_rank for b in got} == {0}
    hash_type = int if variant == "int" else bytes
    for b in got:
        for e in b.events:
            if not isinstance(e, VllmAllBlocksCleared):
                assert all(type(h) is hash_type for h in e.block_hashes)
    if variant == "bytes":
        assert {len(h) for b in got for e in stores_of(b) for h in e.block_hashes} == {32}
    else:  # unsigned: some of them are past 2**63
        assert any(h >= 1 << 63 for b in got for e in stores_of(b) for h in e.block_hashes)


@pytest.mark.parametrize("variant", VARIANTS)
def test_each_call_stores_the_full_blocks_of_its_prompt_and_never_the_tail(variant):
    cap = load(variant)
    got = batches(variant)
    a = cap.request("a")["prompt_token_ids"]
    assert len(a) == 4 * B + 7
    (first,) = stores_of(got[0])
    assert first.token_ids == tuple(a[: 4 * B]) and first.block_size == B and first.parent_block_hash is None
    assert first.medium == "GPU" and first.lora_name is None and first.lora_id is None and first.group_idx == 0
    assert first.extra_keys == (None,) * 4
    # b shares a's first 3 blocks: one new block, chained to a's third
    (second,) = stores_of(got[1])
    b = cap.request("b")["prompt_token_ids"]
    assert second.token_ids == tuple(b[3 * B: 4 * B]) and second.parent_block_hash == first.block_hashes[2]
    # a again: all 4 blocks hit, nothing new stored
    assert cap.request("a_again")["live_frames"] == cap.request("b")["live_frames"]
    for i in range(4):
        name = f"fill_{i}"
        (stored,) = stores_of(got[cap.frames_before(name)])
        assert stored.token_ids == tuple(cap.request(name)["prompt_token_ids"][: 4 * B])


@pytest.mark.parametrize("variant", VARIANTS)
def test_vllm_hashes_are_sha256_cbor_of_the_prompt_blocks_with_the_default_seed(variant):
    """The published hashes, recomputed from the prompt's tokens by the definition (vLLM's
    sha256_cbor, NONE_HASH from "vllm-none-hash"; the cache salt tagged on block 0)."""
    cap = load(variant)
    got = batches(variant)
    a = cap.request("a")["prompt_token_ids"]
    assert stores_of(got[0])[0].block_hashes == tuple(as_published(sha256_cbor_chain(a), variant))
    b = cap.request("b")["prompt_token_ids"]
    assert stores_of(got[1])[0].block_hashes == tuple(as_published(sha256_cbor_chain(b)[3:], variant))
    salted = cap.request("salted")
    (stored,) = stores_of(got[cap.frames_before("salted")])
    assert salted["cache_salt"] == "salt-1" and stored.extra_keys == (("salt-1",), None, None, None)
    extras = [(("cache_salt", "salt-1"),), None, None, None]
    assert stored.block_hashes == tuple(as_published(sha256_cbor_chain(a, extras), variant))
    assert set(stored.block_hashes).isdisjoint(stores_of(got[0])[0].block_hashes)


@pytest.mark.parametrize("variant", VARIANTS)
def test_removed_hashes_were_stored_before_and_the_reset_clears_all(variant):
    cap = load(variant)
    cached: dict = {}
    removed = cleared = 0
    for batch in batches(variant):
        for e in batch.events:
            if isinstance(e, VllmBlockStored):
                for h in e.block_hashes:
                    cached[h] = cached.get(h, 0) + 1
            elif isinstance(e, VllmBlockRemoved):
                assert e.medium == "GPU"
                for h in e.block_hashes:
                    assert cached.get(h, 0) > 0, "a removal of a hash never stored"
                    cached[h] -= 1
                    removed += 1
            else:
                assert batch.seq == cap.reset["live_frames"], "the clear rides on the step after the reset"
                cached.clear()
                cleared += 1
    assert removed >= 4 and cleared == 1


@pytest.mark.parametrize("variant", VARIANTS)
def test_replay_replies_repeat_the_live_messages_and_end_with_seq_minus_one(variant):
    cap = load(variant)
    from_one, past_end = cap.replays
    assert from_one["start_seq"] == 1 and from_one["request"] == replay_request(1)
    *replies, end = from_one["replies"]
    assert [r[1:] for r in replies] == cap.live[1:]
    assert [decode_replay_reply(r) for r in replies] == batches(variant)[1:]
    assert end == [b"", b"", b"\xff" * 8, b""] and decode_replay_reply(end) is None
    assert past_end["start_seq"] == len(cap.live) and past_end["replies"] == [end]


# -- forms and malformed input ------------------------------------------------------------------------
def stored_map(**override) -> dict:
    ev = {"type": "BlockStored", "block_hashes": [1, (1 << 64) - 1], "parent_block_hash": None,
          "token_ids": [5, 6, 7, 8], "block_size": 2, "lora_id": None, "medium": "GPU", "lora_name": None}
    ev.update(override)
    return {k: v for k, v in ev.items() if v is not ...}


def message(events: list, seq: int = 3, ts=1.5, rank=0) -> list[bytes]:
    return [b"kv", seq.to_bytes(8, "big"), msgpack.packb([ts, events, rank])]


def test_the_array_form_reads_fields_by_position_and_ignores_trailing_ones():
    arr = ["BlockStored", [9, 10], 8, [1, 2, 3, 4], 2, None, "CPU", None, [["s"], None], 0, "full", None, "new field"]
    assert decode_event(arr) == VllmBlockStored((9, 10), 8, (1, 2, 3, 4), 2, None, "CPU", None, (("s",), None), 0)
    assert decode_event(["BlockRemoved", [b"\x01" * 32], "GPU", 0, "LOCAL"]) == VllmBlockRemoved((b"\x01" * 32,), "GPU", 0)
    assert decode_event(["BlockRemoved", [4]]) == VllmBlockRemoved((4,))
    assert decode_event(["AllBlocksCleared", "future"]) == VllmAllBlocksCleared()


def test_the_map_form_ignores_unknown_keys_and_omitted_defaults():
    got = decode_event(stored_map(session_id="x", kv_cache_spec_kind="full_attention", lora_id=..., medium=...))
    assert got == VllmBlockStored((1, (1 << 64) - 1), None, (5, 6, 7, 8), 2)


def test_a_batch_without_dp_rank_and_with_trailing_fields_decodes():
    assert decode_payload(msgpack.packb([2, []]), 5) == VllmBatch(5, 2.0, ())
    assert decode_payload(msgpack.packb([2.5, [{"type": "AllBlocksCleared"}], 1, "x"]), 0) == VllmBatch(
        0, 2.5, (VllmAllBlocksCleared(),), 1)


@pytest.mark.parametrize(("frames", "field"), [
    ([b"kv", b"\x00" * 8], "frames"),
    ([b"kv", b"\x00" * 7, msgpack.packb([1.0, [], 0])], "seq"),
    ([b"kv", b"\xff" * 8, msgpack.packb([1.0, [], 0])], "seq"),
    ([b"kv", b"\x00" * 8, msgpack.packb([1.0, [], 0])[:-2]], "payload"),
    ([b"kv", b"\x00" * 8, b"\xc1"], "payload"),
    ([b"kv", b"\x00" * 8, msgpack.packb({"ts": 1.0})], "payload"),
    ([b"kv", b"\x00" * 8, msgpack.packb(["x", [], 0])], "ts"),
    ([b"kv", b"\x00" * 8, msgpack.packb([1.0, {}, 0])], "events"),
    ([b"kv", b"\x00" * 8, msgpack.packb([1.0, [], "0"])], "dp_rank"),
])
def test_malformed_messages_name_the_field(frames, field):
    with pytest.raises(VllmEventDecodeError) as err:
        decode_message(frames)
    assert err.value.field == field and str(err.value).startswith(f"{field}: ")


@pytest.mark.parametrize(("event", "field"), [
    (stored_map(block_hashes="ab"), "events[0].block_hashes"),
    (stored_map(block_hashes=[1, -2]), "events[0].block_hashes[1]"),
    (stored_map(block_hashes=[True]), "events[0].block_hashes[0]"),
    (stored_map(block_hashes=[b""]), "events[0].block_hashes[0]"),
    (stored_map(block_hashes=[1.5]), "events[0].block_hashes[0]"),
    (stored_map(parent_block_hash="p"), "events[0].parent_block_hash"),
    (stored_map(token_ids=[1, "2"]), "events[0].token_ids[1]"),
    (stored_map(block_size=0), "events[0].block_size"),
    (stored_map(block_size=...), "events[0].block_size"),
    (stored_map(medium=3), "events[0].medium"),
    (stored_map(lora_name=b"x"), "events[0].lora_name"),
    (stored_map(extra_keys=[None]), "events[0].extra_keys"),
    (stored_map(extra_keys=[None, "s"]), "events[0].extra_keys[1]"),
    (stored_map(group_idx="0"), "events[0].group_idx"),
    ({"type": "BlockRemoved"}, "events[0].block_hashes"),
    ({"type": "BlockEvicted", "block_hashes": []}, "events[0].type"),
    ({"block_hashes": []}, "events[0].type"),
    ([], "events[0]"),
    ([3, [1]], "events[0].type"),
    ("BlockStored", "events[0]"),
    (["BlockStored", [1], None, [1, 2]], "events[0].block_size"),
])
def test_malformed_events_name_the_field(event, field):
    with pytest.raises(VllmEventDecodeError) as err:
        decode_message(message([event]))
    assert err.value.field == field, str(err.value)


def test_replay_replies_need_the_delimiter_and_four_frames():
    with pytest.raises(VllmEventDecodeError, match="^frames: "):
        decode_replay_reply(message([]))
    with pytest.raises(VllmEventDecodeError, match=r"^frames\[0\]: "):
        decode_replay_reply([b"x", *message([])])
    with pytest.raises(VllmEventDecodeError, match="^start_seq: "):
        replay_request(-1)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_truncated_or_corrupted_captured_payloads_raise_only_the_decode_error(data):
    frames = data.draw(st.sampled_from(load("int").live + load("bytes").live))
    payload = frames[2]
    cut = data.draw(st.integers(0, len(payload)))
    flip = data.draw(st.integers(0, len(payload) - 1))
    bad = bytearray(payload[:cut] if data.draw(st.booleans()) else payload)
    if cut < len(bad):
        bad[flip % len(bad)] ^= data.draw(st.integers(1, 255))
    with contextlib.suppress(VllmEventDecodeError):
        decode_message([frames[0], frames[1], bytes(bad)])


@settings(max_examples=300, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.floats() | st.text(max_size=4)
                    | st.binary(max_size=4), lambda c: st.lists(c, max_size=5)
                    | st.dictionaries(st.sampled_from(["type", "block_hashes", "token_ids", "block_size"]) | st.text(max_size=3), c,
                                      max_size=5), max_leaves=30))
def test_any_msgpack_value_as_a_payload_raises_only_the_decode_error(value):
    with contextlib.suppress(VllmEventDecodeError):
        decode_payload(msgpack.packb(value), 0)
