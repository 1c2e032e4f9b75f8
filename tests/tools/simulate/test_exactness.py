"""The simulator reproduces the oracles exactly where they must agree, and
a hand-worked case of three requests gets the TTFTs the timing model gives.

The oracles apply the engine's lookup rule (the last prompt token is always recomputed), so they
sit a little under ``kvroute_tools.trace.hit_rate_bounds``, which counts every leading seen id
(0.21549 against 0.21574 ideal on these 1,000 requests)."""

from __future__ import annotations

import dataclasses

import pytest

from kvroute_tools.simulate.cluster import SimConfig, simulate
from kvroute_tools.simulate.oracles import oracle_rates, prefill_alone_seconds, ttft_floor
from kvroute_tools.simulate.timing import TimingModel
from kvroute_tools.trace import TRACE_BLOCK_TOKENS, TraceRequest, load_mooncake


def _hit_tokens(run) -> tuple[int, int]:
    return sum(r.cached_tokens for r in run.requests), sum(r.prompt_tokens for r in run.requests)


def _unlimited(trace, replicas: int) -> SimConfig:
    # Unlimited caches (every block of every prompt and output fits) and a budget that prefills any
    # prompt in the step that admits it, so that each request sees every block routed before it.
    blocks = sum(-(-(r.input_length + r.output_length) // 512) + 1 for r in trace) + 2
    return SimConfig(replicas=replicas, num_blocks=blocks, max_num_batched_tokens=200_000, max_num_seqs=2000)


@pytest.fixture(scope="module")
def first_1000() -> list[TraceRequest]:
    return load_mooncake(limit=1000)


@pytest.mark.parametrize("budget", [200_000, 8192])
def test_one_replica_with_an_unlimited_cache_is_the_ideal_bound(first_1000, budget):
    # With the default budget (8192) long prompts take several steps; on these requests no
    # request sharing a prefix arrives while that prefix is still being prefilled, so the bound
    # holds there too.
    cfg = dataclasses.replace(_unlimited(first_1000, 1), max_num_batched_tokens=budget)
    run = simulate(first_1000, cfg, "kvroute")
    hit, total = _hit_tokens(run)
    oracle = oracle_rates(first_1000, 1, 10**9, 512, 512)
    assert total == oracle.prompt_tokens
    assert hit / total == oracle.ideal
    assert 0.21 < oracle.ideal < 0.22


def test_round_robin_over_unlimited_caches_is_the_round_robin_bound(first_1000):
    run = simulate(first_1000, _unlimited(first_1000, 4), "round_robin")
    hit, total = _hit_tokens(run)
    assert hit / total == oracle_rates(first_1000, 4, 10**9, 512, 512).round_robin
    assert run.routed == [250, 250, 250, 250]


def _req(t_ms: float, ids: tuple[int, ...], tokens: int, outputs: int) -> TraceRequest:
    # 4 tokens per trace block: input_length is in the trace's 512-token units.
    return TraceRequest(t_ms, tokens * TRACE_BLOCK_TOKENS // 4, outputs, ids)


def test_three_requests_get_the_ttfts_the_timing_model_gives():
    # A step costs max(10 ms, 1 ms per token); nothing else. Block size 4, one replica.
    timing = TimingModel(overhead_s=0.0, weights_s=0.010, token_s=0.001, kv_token_s=0.0)
    cfg = SimConfig(replicas=1, num_blocks=64, block_size=4, tokens_per_block=4, timing=timing,
                    max_num_batched_tokens=64)
    trace = [_req(0, (1, 2), 8, 4), _req(0, (1, 3), 8, 1), _req(25, (1, 2, 4), 12, 1)]
    a, b, c = simulate(trace, cfg, "kvroute").requests
    # t=0: a is routed to the idle replica, whose first step starts at once: a's 8 tokens, 10 ms.
    # b, routed at the same instant, waits for the next step.
    assert a.first_token_s == 0.010
    # t=10 ms: a's decode + b, which hits a's first block (its only lookable one: (8 - 1) // 4 = 1)
    # and computes 4: 5 tokens, 10 ms. b samples its only token and is done.
    assert (b.cached_tokens, b.first_token_s, b.finish_s) == (4, 0.020, 0.020)
    # t=20 ms: a decodes alone in a window of 2 steps; c arrives at 25 ms, inside the first, which
    # ends at 30 ms: c is admitted there, hits a's two blocks (8 tokens), computes 4, beside a's
    # last decode (5 tokens: 10 ms) -> both sample at 40 ms.
    assert c.cached_tokens == 8
    assert c.first_token_s - c.arrival_s == pytest.approx(0.015, abs=1e-12)
    assert a.finish_s == pytest.approx(0.040, abs=1e-12)
    assert (a.finish_s - a.first_token_s) / 3 == pytest.approx(0.010, abs=1e-12)


def test_a_decode_window_lasts_as_long_as_its_steps():
    t = TimingModel()
    assert t.decode_window(7, 5000, 9) == pytest.approx(sum(t.step_seconds(0, 7, 5000 + 7 * i) for i in range(1, 10)))


def test_prefill_alone_takes_the_timing_models_steps():
    # 20,000 tokens, 4,096 cached, budget 8,192: chunks of 8,192 (context 12,288) and 7,712
    # (context 20,000). Step = 1 ms + max(10 ms, 1 us x tokens) + 1 ns x context.
    timing = TimingModel(overhead_s=0.001, weights_s=0.010, token_s=1e-6, kv_token_s=1e-9)
    expected = (0.001 + 0.010 + 12_288e-9) + (0.001 + 0.010 + 20_000e-9)
    assert prefill_alone_seconds(20_000, 4_096, timing, 8_192) == pytest.approx(expected, abs=1e-15)
    assert prefill_alone_seconds(20_000, 4_096, timing, 1_000) == pytest.approx(
        16 * 0.011 + (sum(range(5_096, 20_000, 1_000)) + 20_000) * 1e-9, abs=1e-12)  # 15 x 1,000 + 904


@pytest.mark.parametrize("budget", [200_000, 8192])
def test_requests_alone_on_one_unlimited_replica_reach_the_ttft_floor(first_1000, budget):
    # The first 200 requests, 1,000 s apart (each done before the next arrives), one replica with
    # an unlimited cache: every TTFT is the request's prefill alone with the ideal oracle's hits.
    trace = [dataclasses.replace(r, timestamp_ms=i * 1_000_000.0) for i, r in enumerate(first_1000[:200])]
    run = simulate(trace, dataclasses.replace(_unlimited(trace, 1), max_num_batched_tokens=budget), "kvroute")
    measured = sum(r.first_token_s - r.arrival_s for r in run.requests) / len(trace)
    floor = ttft_floor(trace, TimingModel(), 512, 512, budget)
    assert measured == pytest.approx(floor, rel=1e-9)
    assert floor > 0
