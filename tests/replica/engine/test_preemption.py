"""Preemption by recompute and aborts through the real engine: outputs survive preemption
unchanged, and every path out of the engine (finish, abort mid-prefill, abort mid-decode, any mix
of them) returns every block (DESIGN.md §3.1, §3.2)."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from replica.engine.engine import LLMEngine
from replica.engine.params import FinishReason, SamplingParams
from replica.engine.request import RequestStatus
from replica.telemetry import sample_engine
from replica.wire import load_response
from tests.support import make_cpu_engine, random_tokens

torch.set_num_threads(1)

B = 16
GREEDY = dict(temperature=0.0, ignore_eos=True)
make_engine = functools.partial(make_cpu_engine, block_size=B, num_blocks=64)


def assert_no_blocks_held(engine: LLMEngine) -> None:
    pool = engine.kv.block_pool
    assert engine.usage == 0.0
    assert engine.kv.num_free_blocks == engine.num_blocks - 1
    assert not engine.kv.req_to_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks[1:])
    assert not engine.scheduler.running and not engine.scheduler.waiting and engine.is_idle()


def assert_block_invariants(engine: LLMEngine) -> None:
    """Running requests hold exactly the blocks their computed tokens need; waiting ones hold none;
    a block's ref_cnt is the number of tables it is in; free + in use = usable."""
    kv, sched = engine.kv, engine.scheduler
    assert len(sched.running) <= sched.max_num_seqs
    refs: dict[int, int] = {}
    for req in sched.running:
        ids = kv.get_block_ids(req.request_id)
        assert len(ids) == -(-req.num_computed_tokens // B)
        for i in ids:
            refs[i] = refs.get(i, 0) + 1
    for req in sched.waiting:
        assert req.request_id not in kv.req_to_blocks and req.num_computed_tokens == 0
    assert set(kv.req_to_blocks) == {r.request_id for r in sched.running}
    for block in kv.block_pool.blocks[1:]:
        assert block.ref_cnt == refs.get(block.block_id, 0)
    assert kv.num_free_blocks + len(refs) == engine.num_blocks - 1


PROMPT_LENS = (60, 75, 100, 83, 91, 68)


def test_requests_preempted_under_a_small_kv_budget_finish_with_unconstrained_outputs(default_model_dir):
    prompts = [random_tokens(n, seed=10 + i) for i, n in enumerate(PROMPT_LENS)]
    params = SamplingParams(max_tokens=40, **GREEDY)
    roomy = make_engine(default_model_dir, num_blocks=96, max_num_batched_tokens=512)
    expected = [r.output_token_ids for r in roomy.generate(prompts, params)]
    assert roomy.scheduler.num_preemptions == 0

    # 19 usable blocks (304 tokens) for 6 requests that need 7-9 blocks each at the end.
    tight = make_engine(default_model_dir, num_blocks=20, max_num_batched_tokens=128)
    reqs = [tight.add_request(p, params, request_id=f"r{i}") for i, p in enumerate(prompts)]
    finished = {}
    preempted_steps = 0
    while tight.has_unfinished_requests():
        for out in tight.step():
            if out.finished:
                finished[out.request_id] = out.finish_reason
        preempted_steps += tight.last_step.num_preempted > 0
        assert_block_invariants(tight)
    assert tight.scheduler.num_preemptions > 0 and preempted_steps > 0
    assert any(r.num_preemptions > 0 for r in reqs)
    assert [r.output_token_ids for r in reqs] == expected
    assert finished == {f"r{i}": FinishReason.LENGTH for i in range(len(prompts))}
    assert_no_blocks_held(tight)
    assert tight.kv.block_pool.free_block_queue.num_free_blocks == 20 - 1


def test_preemption_recompute_is_counted_apart_from_prefix_cache_queries_and_hits(default_model_dir):
    """vLLM excludes a preempted request's re-admission from the prefix cache stats: with prompts
    sharing no prefix, queries are the prompt lengths and hits 0, preempted or not; the recompute
    (the re-admitted prompt + outputs not found in the cache) is counted on its own."""
    prompts = [random_tokens(40, seed=30), random_tokens(40, seed=31)]  # no shared block
    params = SamplingParams(max_tokens=40, **GREEDY)
    roomy = make_engine(default_model_dir, num_blocks=64, max_num_seqs=2)
    roomy.generate(prompts, params)
    assert roomy.scheduler.num_preemptions == 0
    assert (roomy.kv.stats.queries, roomy.kv.stats.hits) == (80, 0)
    assert roomy.kv.stats.recomputed_tokens == 0

    # 9 usable blocks for 2 requests that need 5 each at the end (80 tokens): one is preempted.
    tight = make_engine(default_model_dir, num_blocks=10, max_num_seqs=2)
    tight.generate(prompts, params)
    stats = tight.kv.stats
    assert tight.scheduler.num_preemptions > 0
    assert (stats.queries, stats.hits, stats.requests) == (80, 0, 2)  # equal to the un-preempted run's
    assert stats.preempted_requests == tight.scheduler.num_preemptions
    assert stats.preempted_queries > 0 and stats.preempted_hits > 0  # its own surviving blocks
    assert stats.recomputed_tokens == stats.preempted_queries - stats.preempted_hits > 0
    load = load_response("r", sample_engine(tight), 0)  # what GetLoad and the metrics export
    assert (load.prefix_cache_queries, load.prefix_cache_hits) == (80, 0)
    assert load.recomputed_tokens == stats.recomputed_tokens


@pytest.fixture(scope="module")
def engine(default_model_dir) -> LLMEngine:
    return make_engine(default_model_dir, num_blocks=24, max_num_batched_tokens=32, max_num_seqs=4)


def test_abort_mid_chunked_prefill_frees_every_block(engine):
    assert_no_blocks_held(engine)
    engine.add_request(random_tokens(100, seed=20), SamplingParams(max_tokens=5, **GREEDY), request_id="pf")
    assert engine.step() == []  # first 32-token chunk: nothing sampled yet
    engine.step()
    req = engine.scheduler.running[0]
    assert req.num_computed_tokens == 64 < req.num_prompt_tokens
    assert len(engine.kv.get_block_ids("pf")) == 4 and engine.usage > 0
    out = engine.abort_request("pf")
    assert out.finished and out.finish_reason is FinishReason.ABORT and out.completion_tokens == 0
    assert req.status is RequestStatus.FINISHED
    assert_no_blocks_held(engine)
    assert engine.abort_request("pf") is None  # idempotent
    assert engine.step() == []


def test_abort_mid_decode_frees_every_block(engine):
    assert_no_blocks_held(engine)
    engine.add_request(random_tokens(40, seed=21), SamplingParams(max_tokens=50, **GREEDY), request_id="dc")
    engine.add_request(
        random_tokens(20, seed=22), SamplingParams(max_tokens=50, **GREEDY), request_id="other"
    )
    produced = 0
    while produced < 6:
        produced += sum(len(o.new_token_ids) for o in engine.step() if o.request_id == "dc")
    assert engine.last_step.num_decode_tokens >= 1
    out = engine.abort_request("dc")
    assert out.finished and out.finish_reason is FinishReason.ABORT and out.completion_tokens == 6
    assert engine.kv.get_block_ids("other")  # the other request keeps running, untouched
    engine.abort_request("other")
    assert_no_blocks_held(engine)


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 120), st.integers(1, 40)),
        st.tuples(st.just("add"), st.integers(1, 120), st.integers(1, 40)),
        st.tuples(st.just("abort"), st.integers(0, 30)),
        st.tuples(st.just("step"), st.integers(1, 12)),
    ),
    min_size=2,
    max_size=16,
)


@pytest.fixture(scope="module")
def tight_engine(default_model_dir) -> LLMEngine:
    # One engine for every hypothesis example (loading one costs more than an example): a tight
    # budget (9 usable blocks, 4 seqs, 24 tokens a step) so that preemption and chunking are common.
    return make_engine(default_model_dir, num_blocks=10, max_num_batched_tokens=24, max_num_seqs=4)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, seed=st.integers(0, 2**16))
def test_random_adds_aborts_and_steps_leak_no_blocks(tight_engine, ops, seed):
    """Any interleaving of adds (prompts sharing prefixes, so caching and preemption both happen),
    aborts of live or finished or unknown ids, and steps keeps the block invariants after every
    step, and once everything is finished or aborted no block is held."""
    engine = tight_engine
    assert_no_blocks_held(engine)
    base = random_tokens(120, seed=seed)
    reqs = []
    for op in ops:
        if op[0] == "add":
            _, n, max_tokens = op
            prompt = base[: n // 2] + random_tokens(n - n // 2, seed=seed + len(reqs) + 1)
            params = SamplingParams(max_tokens=max_tokens, **GREEDY)
            reqs.append(engine.add_request(prompt, params, request_id=f"q{len(reqs)}-{seed}"))
        elif op[0] == "abort":
            if reqs:
                engine.abort_request(reqs[op[1] % len(reqs)].request_id)
            assert engine.abort_request("never-added") is None
        else:
            for _ in range(op[1]):
                engine.step()
                assert_block_invariants(engine)
    for _ in range(3):
        engine.step()
        assert_block_invariants(engine)
    for req in reqs:
        engine.abort_request(req.request_id)
    assert_no_blocks_held(engine)
    for req in reqs:
        assert req.status is RequestStatus.FINISHED
        # A request that finished on its own produced exactly its budget (ignore_eos, greedy).
        if req.finish_reason is FinishReason.LENGTH:
            assert len(req.output_token_ids) == req.max_tokens  # effective: max_model_len may clamp it
        else:
            assert req.finish_reason is FinishReason.ABORT
