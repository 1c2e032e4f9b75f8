"""The replica's measured speed (replica.engine.step_rates): hand-worked step samples, and the real
engine measuring its own steps."""

from __future__ import annotations

import pytest

from replica.engine.step_rates import StepRates, StepTimer


def test_nothing_measured_reads_zero():
    timer = StepTimer()
    assert timer.rates == StepRates(0.0, 0.0)
    timer.observe(0, 0, 0.5)  # a step that ran nothing is no sample
    timer.observe(100, 2, 0.5)  # nor is a small prefill
    timer.observe(0, 4, 0.009)  # one batch size gives no slope
    assert timer.rates == StepRates(0.0, 0.0)


def test_decode_steps_give_the_slope_and_large_prefill_steps_the_rate():
    timer = StepTimer(min_prefill_tokens=256)
    timer.observe(0, 4, 0.009)  # 1 ms a step + 2 ms per sequence
    timer.observe(0, 6, 0.013)
    timer.observe(0, 8, 0.017)
    assert timer.rates.decode_seconds_per_running == pytest.approx(0.002)
    assert timer.rates.prefill_tokens_per_s == 0.0
    # 1,000 prompt tokens with 5 decodes in 110 ms: 10 ms of decodes, 100 ms of prefill.
    timer.observe(1000, 5, 0.110)
    assert timer.rates.prefill_tokens_per_s == pytest.approx(10_000.0)
    # A prefill-only step of 3,000 tokens in 200 ms: (1,000 + 3,000) / (0.100 + 0.200) s.
    timer.observe(3000, 0, 0.200)
    assert timer.rates == StepRates(pytest.approx(4000 / 0.3), pytest.approx(0.002))


def test_only_the_last_window_steps_of_each_kind_count():
    timer = StepTimer(window=2)
    timer.observe(1000, 0, 1.0)  # 1,000 tokens/s, pushed out below
    timer.observe(1000, 0, 0.1)
    timer.observe(1000, 0, 0.1)
    assert timer.rates.prefill_tokens_per_s == pytest.approx(10_000.0)
    timer.observe(0, 1, 0.002)  # 1 ms per sequence, pushed out below
    timer.observe(0, 2, 0.003)
    timer.observe(0, 4, 0.009)  # (2, 3 ms) and (4, 9 ms): 3 ms per sequence
    assert timer.rates.decode_seconds_per_running == pytest.approx(0.003)


def test_a_negative_slope_or_decodes_that_fill_the_prefill_step_read_as_unknown():
    timer = StepTimer()
    timer.observe(0, 2, 0.010)
    timer.observe(0, 4, 0.008)  # noise: more sequences, less time
    assert timer.rates.decode_seconds_per_running == 0.0
    timer = StepTimer()
    timer.observe(0, 1, 0.010)
    timer.observe(0, 2, 0.020)  # 10 ms per sequence
    timer.observe(512, 10, 0.090)  # less than its decodes alone: no time left for the prefill
    assert timer.rates.prefill_tokens_per_s == 0.0


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="window"):
        StepTimer(window=1)
    with pytest.raises(ValueError, match="min_prefill_tokens"):
        StepTimer(min_prefill_tokens=0)


def test_the_engine_measures_its_own_steps(default_model_dir):
    from replica.engine.config import EngineConfig
    from replica.engine.engine import LLMEngine
    from replica.engine.params import SamplingParams

    # A 300-token step budget and 300-token prompts: admitted one after another, so the decodes
    # run in batches of 1 to 3 next to prefill steps of ~300 tokens.
    cfg = EngineConfig(device="cpu", block_size=16, num_blocks=64, max_num_batched_tokens=300, torch_threads=1)
    engine = LLMEngine(default_model_dir, cfg)
    assert engine.step_timer.rates == StepRates()
    prompts = [[10 + i % 500 for i in range(k, k + 300)] for k in (0, 7, 13)]
    engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))
    rates = engine.step_timer.rates
    # Some tens of thousands of tokens/s on one core for this model; the slope is noise-prone on a
    # shared machine (it may read 0, unknown), never negative.
    assert rates.prefill_tokens_per_s > 100 and rates.decode_seconds_per_running >= 0
