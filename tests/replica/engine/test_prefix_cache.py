"""Prefix caching through the real engine: it never changes outputs, a mostly cached prompt
computes only its uncached tail, and DESIGN.md §3.2's seed-doc metadata example holds verbatim."""

from __future__ import annotations

import functools

import pytest
import torch

import replica.engine.runner as runner_module
from replica.attention import build_attention_metadata
from replica.engine.engine import LLMEngine
from replica.engine.params import SamplingParams
from tests.support import make_cpu_engine, random_tokens

torch.set_num_threads(1)

B = 16
GREEDY = dict(temperature=0.0, ignore_eos=True)
make_engine = functools.partial(make_cpu_engine, block_size=B, num_blocks=96)


def run_one(engine: LLMEngine, prompt: list[int], max_tokens: int, rid: str) -> list[int]:
    engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, **GREEDY), request_id=rid)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
    return tokens


def test_outputs_with_prefix_caching_equal_outputs_without(default_model_dir):
    """Prompts sharing prefixes of different lengths (whole blocks, mid-block, identical prompts),
    some arriving while others run: greedy outputs are the same with and without caching."""
    base = random_tokens(150, seed=1)
    prompts = [
        base,
        base[:100] + random_tokens(30, seed=2),  # shares 6 full blocks and 4 tokens of the 7th
        base[:64] + random_tokens(3, seed=3),  # shares exactly 4 blocks
        list(base),  # the whole prompt again: hits all but the last (recomputed) block
        base[:40],  # a prefix of the others
        random_tokens(50, seed=4),  # shares nothing
    ]
    results = {}
    for caching in (False, True):
        engine = make_engine(default_model_dir, enable_prefix_caching=caching, max_num_batched_tokens=96)
        outs = {}
        first = run_one(engine, prompts[0], 8, "r0")  # cached before the others arrive
        outs["r0"] = first
        reqs = [engine.add_request(p, SamplingParams(max_tokens=8, **GREEDY), request_id=f"r{i}")
                for i, p in enumerate(prompts) if i > 0]  # fmt: skip
        while engine.has_unfinished_requests():
            engine.step()
        for r in reqs:
            outs[r.request_id] = r.output_token_ids
        results[caching] = (outs, engine.kv.stats.hits, [r.num_cached_tokens for r in reqs])
    assert results[True][0] == results[False][0]
    assert results[False][1] == 0
    # Hits are whole blocks, never the last prompt token: 6, 4, 9 and 2 blocks.
    assert results[True][2][:4] == [96, 64, 144, 32]
    assert results[True][1] == sum(results[True][2])


def test_ninety_percent_cached_prompt_computes_only_its_uncached_tokens(default_model_dir):
    engine = make_engine(default_model_dir)
    first = random_tokens(320, seed=5)
    run_one(engine, first, 4, "warm")
    second = first[:288] + random_tokens(32, seed=6)  # 18 blocks of 16 shared, then 2 new blocks
    engine.add_request(second, SamplingParams(max_tokens=2, **GREEDY), request_id="hot")
    outs = engine.step()
    st = engine.last_step
    assert st.num_prefix_hit_tokens == 288
    assert st.num_prefill_tokens == st.num_scheduled_tokens == 32
    assert [o.cached_tokens for o in outs] == [288]
    while engine.has_unfinished_requests():
        outs = engine.step()
    assert outs[-1].finished and outs[-1].cached_tokens == 288 and outs[-1].prompt_tokens == 320


@pytest.mark.parametrize("free_order", ["fifo", "lru"])
def test_design_doc_seed_metadata_example(default_model_dir, free_order, monkeypatch):
    """DESIGN.md §3.2, verbatim: "a 997-token prompt on a fresh replica gets blocks 1..63 and
    slot_mapping 16..1012. If that request decodes until its KV fills blocks 1..126 exactly (2,016
    tokens) and finishes, the same 997-token prompt again hits 62 blocks (992 tokens), computes 5
    tokens in new block 127: num_actual_tokens=5, max_query_len=5, query_start_loc=[0,5],
    seq_lens=[997], slot_mapping=[2032..2036] (padded to 8 with -1 when the batch is padded to 8),
    block_table row 1..62, 127."

    The KV holds ``num_computed_tokens``: the last sampled token is never computed, and finishing
    frees the request before it is scheduled again. So KV = 2,016 tokens means prompt + output =
    2,017 tokens: max_tokens = 2017 - 997 = 1020.

    Free order: both "fifo" and the default "lru" reproduce the numbers. After the first request
    finishes every one of its 126 blocks is full, hence hashed, so both orders append them to the
    tail (reversed: 126..1) behind the never-used 127..; the 5 new tokens then take the head, 127.
    The orders would differ only for a freed block without a hash (lru puts it at the head).
    """
    calls = []

    def recording_build(query_lens, seq_lens, block_tables, block_size, **kw):
        calls.append((list(query_lens), list(seq_lens), [list(t) for t in block_tables]))
        meta, positions = build_attention_metadata(query_lens, seq_lens, block_tables, block_size, **kw)
        calls[-1] += (meta,)
        return meta, positions

    monkeypatch.setattr(runner_module, "build_attention_metadata", recording_build)
    # 128 blocks: 0 (null) + 1..127; max_model_len = 127 * 16 = 2032 >= 2017.
    engine = make_engine(default_model_dir, num_blocks=128, free_order=free_order)
    prompt = random_tokens(997, seed=7)
    params = SamplingParams(max_tokens=2017 - 997, **GREEDY)

    engine.add_request(prompt, params, request_id="first")
    engine.step()
    assert engine.kv.get_block_ids("first") == list(range(1, 64))
    *_, meta = calls[-1]
    assert meta.slot_mapping.tolist() == list(range(16, 1013))
    while engine.has_unfinished_requests():
        engine.step()
    assert len(engine.kv.req_to_blocks) == 0
    # The last step computed token 2015 (the 2,016th): the request's KV filled blocks 1..126 exactly.
    query_lens, seq_lens, tables, _ = calls[-1]
    assert (query_lens, seq_lens, tables) == ([1], [2016], [list(range(1, 127))])
    assert engine.kv.num_free_blocks == 127

    engine.add_request(prompt, SamplingParams(max_tokens=1, **GREEDY), request_id="again")
    outs = engine.step()
    assert engine.last_step.num_prefix_hit_tokens == 62 * 16 == 992
    assert engine.last_step.num_scheduled_tokens == 5
    query_lens, seq_lens, tables, meta = calls[-1]
    assert tables == [list(range(1, 63)) + [127]]
    assert meta.num_actual_tokens == 5
    assert meta.max_query_len == 5
    assert meta.query_start_loc.tolist() == [0, 5]
    assert meta.seq_lens.tolist() == [997]
    assert meta.slot_mapping.tolist() == [2032, 2033, 2034, 2035, 2036]
    assert meta.block_table.tolist() == [list(range(1, 63)) + [127]]
    padded, _ = build_attention_metadata(query_lens, seq_lens, tables, B, pad_to=8)
    assert padded.slot_mapping.tolist() == [2032, 2033, 2034, 2035, 2036, -1, -1, -1]
    assert padded.num_actual_tokens == 5
    assert outs[0].finished and outs[0].cached_tokens == 992
