"""build_attention_metadata: DESIGN.md §3.2's seed-doc example verbatim, plus hand-worked batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from replica.attention import AttentionMetadata, build_attention_metadata

BLOCK_SIZE = 16


def test_seed_doc_fresh_997_token_prompt_gets_blocks_1_to_63_and_slots_16_to_1012():
    # "a 997-token prompt on a fresh replica gets blocks 1..63 and slot_mapping 16..1012"
    blocks = list(range(1, 64))
    md, positions = build_attention_metadata([997], [997], [blocks], BLOCK_SIZE)

    assert md.num_actual_tokens == 997
    assert md.max_query_len == 997
    assert md.max_seq_len == 997
    assert md.query_start_loc.tolist() == [0, 997]
    assert md.seq_lens.tolist() == [997]
    assert md.slot_mapping.tolist() == list(range(16, 1013))
    assert md.block_table.tolist() == [blocks]
    assert positions.tolist() == list(range(997))


def test_seed_doc_cached_rerun_computes_5_tokens_in_block_127():
    # "the same 997-token prompt again hits 62 blocks (992 tokens), computes 5 tokens in new block
    # 127: num_actual_tokens=5, max_query_len=5, query_start_loc=[0,5], seq_lens=[997],
    # slot_mapping=[2032..2036], block_table row 1..62, 127"
    row = [*range(1, 63), 127]
    md, positions = build_attention_metadata([5], [997], [row], BLOCK_SIZE)

    assert md.num_actual_tokens == 5
    assert md.max_query_len == 5
    assert md.query_start_loc.tolist() == [0, 5]
    assert md.seq_lens.tolist() == [997]
    assert md.max_seq_len == 997
    assert md.slot_mapping.tolist() == [2032, 2033, 2034, 2035, 2036]
    assert md.block_table.tolist() == [row]
    assert positions.tolist() == [992, 993, 994, 995, 996]


def test_seed_doc_cached_rerun_padded_to_8_gets_three_minus_one_slots():
    # "(padded to 8 with -1 when the batch is padded to 8)"
    row = [*range(1, 63), 127]
    md, positions = build_attention_metadata([5], [997], [row], BLOCK_SIZE, pad_to=8)

    assert md.num_actual_tokens == 5
    assert md.num_tokens == 8
    assert md.slot_mapping.tolist() == [2032, 2033, 2034, 2035, 2036, -1, -1, -1]
    assert positions.tolist() == [992, 993, 994, 995, 996, 0, 0, 0]
    assert md.query_start_loc.tolist() == [0, 5]


def test_mixed_decode_and_prefill_batch_hand_worked():
    # block_size 4.
    # req 0: decode, seq_len 6 (positions 0..5), blocks [7, 3] -> query position 5 -> block 3 offset 1
    #        slot 3*4+1 = 13
    # req 1: fresh prefill of 5 tokens, blocks [2, 9] -> positions 0..4 -> slots 8,9,10,11, 36
    # req 2: chunked prefill: 3 new tokens after 4 computed (seq_len 7), blocks [5, 1]
    #        positions 4,5,6 -> block 1 offsets 0,1,2 -> slots 4,5,6
    # req 3: decode at a block boundary, seq_len 9, blocks [4, 6, 8] -> position 8 -> block 8 off 0
    #        slot 32
    md, positions = build_attention_metadata(
        query_lens=[1, 5, 3, 1],
        seq_lens=[6, 5, 7, 9],
        block_tables=[[7, 3], [2, 9], [5, 1], [4, 6, 8]],
        block_size=4,
        pad_to=12,
    )
    assert md.num_actual_tokens == 10
    assert md.max_query_len == 5
    assert md.max_seq_len == 9
    assert md.query_start_loc.tolist() == [0, 1, 6, 9, 10]
    assert md.seq_lens.tolist() == [6, 5, 7, 9]
    assert md.slot_mapping.tolist() == [13, 8, 9, 10, 11, 36, 4, 5, 6, 32, -1, -1]
    assert positions.tolist() == [5, 0, 1, 2, 3, 4, 4, 5, 6, 8, 0, 0]
    assert md.block_table.tolist() == [[7, 3, 0], [2, 9, 0], [5, 1, 0], [4, 6, 8]]


def test_dtypes_and_host_copies_follow_the_contract():
    md, positions = build_attention_metadata([2, 1], [2, 3], [[1], [2]], 4, pad_to=4)
    assert isinstance(md, AttentionMetadata)
    assert md.query_start_loc.dtype == torch.int32
    assert md.seq_lens.dtype == torch.int32
    assert md.slot_mapping.dtype == torch.int64
    assert md.block_table.dtype == torch.int32
    assert positions.dtype == torch.int64
    assert md.query_start_loc_cpu.tolist() == [0, 2, 3]
    assert md.seq_lens_cpu.tolist() == [2, 3]
    assert md.num_reqs == 2


def test_padded_numpy_block_table_gives_same_slots_as_ragged_lists():
    ragged = [[3, 1], [2], [5, 6, 4]]
    padded = np.array([[3, 1, 0], [2, 0, 0], [5, 6, 4]], dtype=np.int32)
    args = dict(query_lens=[2, 1, 4], seq_lens=[6, 2, 11], block_size=4)
    a, pa = build_attention_metadata(block_tables=ragged, **args)
    b, pb = build_attention_metadata(block_tables=padded, **args)
    assert torch.equal(a.slot_mapping, b.slot_mapping)
    assert torch.equal(a.block_table, b.block_table)
    assert torch.equal(pa, pb)


def test_slots_match_a_per_token_loop_on_random_batches():
    rng = np.random.default_rng(0)
    for _ in range(20):
        num_reqs = int(rng.integers(1, 9))
        block_size = int(rng.choice([1, 4, 16]))
        seq_lens = rng.integers(1, 80, size=num_reqs)
        query_lens = [int(rng.integers(1, s + 1)) for s in seq_lens]
        tables = [
            list(rng.permutation(500)[: -(-int(s) // block_size) + int(rng.integers(0, 2))] + 1) for s in seq_lens
        ]
        md, positions = build_attention_metadata(query_lens, seq_lens, tables, block_size)
        expected_slots, expected_pos = [], []
        for q, s, t in zip(query_lens, seq_lens, tables, strict=True):
            for pos in range(int(s) - q, int(s)):
                expected_pos.append(pos)
                expected_slots.append(int(t[pos // block_size]) * block_size + pos % block_size)
        assert md.slot_mapping.tolist() == expected_slots
        assert positions.tolist() == expected_pos


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(query_lens=[], seq_lens=[], block_tables=[]), "empty batch"),
        (dict(query_lens=[1, 1], seq_lens=[1], block_tables=[[1]]), "one entry per request"),
        (dict(query_lens=[0], seq_lens=[3], block_tables=[[1]]), "query_len 0"),
        (dict(query_lens=[4], seq_lens=[3], block_tables=[[1]]), "query_len 4"),
        (dict(query_lens=[1], seq_lens=[5], block_tables=[[1]]), "needs 2"),
        (dict(query_lens=[3], seq_lens=[3], block_tables=[[1]], pad_to=2), "pad_to 2"),
    ],
)
def test_invalid_batches_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_attention_metadata(block_size=4, **kwargs)
