"""Sampler: greedy, seeded reproducibility independent of the batch, filters, distribution, min_tokens."""

from __future__ import annotations

import pytest
import torch

from replica.engine.params import SamplingParams
from replica.engine.sampling import Sampler, SamplingState, _top_k_top_p, apply_penalties

VOCAB = 50
EOS = 3


def _logits(num_reqs: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_reqs, vocab, generator=gen) * 3.0


def _states(params: SamplingParams, n: int) -> list[SamplingState]:
    return [SamplingState(params) for _ in range(n)]


def _sample(sampler: Sampler, logits: torch.Tensor, states, counts=None) -> torch.Tensor:
    return sampler.sample(logits, states, counts if counts is not None else [0] * len(states))


def _chi_square(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic over the tokens with expected count > 0 (samples elsewhere -> inf)."""
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() * samples.numel()
    support = expected > 0
    if counts[~support].sum() > 0:
        return float("inf")
    return float(((counts[support] - expected[support]) ** 2 / expected[support]).sum())


def test_greedy_is_argmax_and_leaves_logits_untouched():
    logits = _logits(8)
    before = logits.clone()
    out = _sample(Sampler(), logits, _states(SamplingParams(temperature=0.0), 8))
    assert out.dtype == torch.int64 and out.shape == (8,)
    assert torch.equal(out, logits.argmax(dim=-1))
    assert torch.equal(logits, before)


def test_greedy_ties_go_to_the_lowest_token_id():
    logits = torch.zeros(2, 10)
    logits[0, [7, 2, 5]] = 4.0
    logits[1] = 1.0
    out = _sample(Sampler(), logits, _states(SamplingParams(temperature=0.0), 2))
    assert out.tolist() == [2, 0]


def test_empty_batch_returns_empty_tensor():
    out = Sampler().sample(torch.empty(0, VOCAB), [], [])
    assert out.shape == (0,) and out.dtype == torch.int64


def test_mismatched_rows_raise():
    with pytest.raises(ValueError):
        Sampler().sample(_logits(2), _states(SamplingParams(), 3), [0, 0, 0])
    with pytest.raises(ValueError):
        Sampler().sample(torch.zeros(VOCAB), [], [])


def _run_seeded(sampler: Sampler, target: SamplingState, position: int, batch: int, steps: int):
    """Sample ``steps`` times with ``target`` at ``position`` among ``batch`` rows; other rows have
    other params (unseeded, greedy, other seeds). The target's logits are the same in every setup."""
    others = [
        SamplingParams(),
        SamplingParams(temperature=0.0),
        SamplingParams(seed=999, top_k=5),
        SamplingParams(temperature=0.5, top_p=0.9),
    ]
    other_states = [SamplingState(others[i % len(others)]) for i in range(batch - 1)]
    tokens = []
    for step in range(steps):
        target_logits = _logits(1, seed=100 + step)
        noise = _logits(batch, seed=1000 + step + batch)
        rows = list(range(batch))
        rows.remove(position)
        logits = torch.empty(batch, VOCAB)
        logits[position] = target_logits[0]
        states: list[SamplingState] = [None] * batch  # type: ignore[list-item]
        states[position] = target
        for r, s in zip(rows, other_states, strict=True):
            logits[r] = noise[r]
            states[r] = s
        tokens.append(int(sampler.sample(logits, states, [step] * batch)[position]))
    return tokens


def test_seeded_request_gives_same_tokens_alone_and_in_a_batch_of_four():
    params = SamplingParams(seed=1234, temperature=1.3)
    alone = _run_seeded(Sampler(seed=1), SamplingState(params), position=0, batch=1, steps=12)
    in_batch = _run_seeded(Sampler(seed=2), SamplingState(params), position=2, batch=4, steps=12)
    assert alone == in_batch
    assert len(set(alone)) > 3  # it really sampled, not a degenerate argmax


def test_seeded_generator_advances_across_steps_and_differs_by_seed():
    logits = torch.zeros(1, 1000)  # uniform: each draw is fresh randomness
    state = SamplingState(SamplingParams(seed=7))
    sampler = Sampler()
    draws = [int(sampler.sample(logits, [state], [i])[0]) for i in range(5)]
    assert len(set(draws)) > 1  # not re-seeded at every step
    again = SamplingState(SamplingParams(seed=7))
    assert [int(sampler.sample(logits, [again], [i])[0]) for i in range(5)] == draws
    other = SamplingState(SamplingParams(seed=8))
    assert [int(sampler.sample(logits, [other], [i])[0]) for i in range(5)] != draws


def test_shared_generator_is_reproducible_with_a_sampler_seed():
    logits = _logits(16)
    a = _sample(Sampler(seed=5), logits, _states(SamplingParams(), 16))
    b = _sample(Sampler(seed=5), logits, _states(SamplingParams(), 16))
    assert torch.equal(a, b)


def test_top_k_1_equals_greedy():
    logits = _logits(64)
    out = _sample(Sampler(seed=0), logits, _states(SamplingParams(top_k=1, temperature=1.5), 64))
    assert torch.equal(out, logits.argmax(dim=-1))


def test_tiny_top_p_equals_greedy():
    logits = _logits(64)
    out = _sample(Sampler(seed=0), logits, _states(SamplingParams(top_p=1e-6, temperature=2.0), 64))
    assert torch.equal(out, logits.argmax(dim=-1))


def test_temperature_sampling_matches_softmax():
    logits = _logits(1, vocab=8, seed=3)[0]
    temperature = 0.7
    n = 20_000
    out = _sample(Sampler(seed=11), logits.expand(n, -1), _states(SamplingParams(temperature=temperature), n))
    probs = torch.softmax(logits / temperature, dim=-1)
    # 7 degrees of freedom: P(chi2 > 30) ~ 1e-4; fixed seed, so deterministic anyway.
    assert _chi_square(out, probs) < 30.0


def test_seeded_rows_also_follow_softmax():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    n = 4000
    states = [SamplingState(SamplingParams(seed=i)) for i in range(n)]
    out = _sample(Sampler(), logits.expand(n, -1), states)
    assert _chi_square(out, torch.softmax(logits, dim=-1)) < 25.0  # 3 dof


def test_top_k_keeps_only_the_k_best_renormalised():
    logits = torch.tensor([0.5, 2.0, -1.0, 1.5, 1.0, 0.0])
    n = 20_000
    out = _sample(Sampler(seed=4), logits.expand(n, -1), _states(SamplingParams(top_k=3), n))
    kept = torch.full_like(logits, float("-inf"))
    kept[[1, 3, 4]] = logits[[1, 3, 4]]
    assert _chi_square(out, torch.softmax(kept, dim=-1)) < 20.0  # 2 dof


def test_top_p_keeps_the_smallest_head_reaching_p():
    probs = torch.tensor([0.1, 0.4, 0.2, 0.3])
    logits = probs.log()
    n = 20_000
    # Sorted: 0.4, 0.3 | 0.2, 0.1. Mass before 0.3 is 0.4 < 0.6, before 0.2 it is 0.7 >= 0.6.
    out = _sample(Sampler(seed=5), logits.expand(n, -1), _states(SamplingParams(top_p=0.6), n))
    assert _chi_square(out, torch.tensor([0.0, 4 / 7, 0.0, 3 / 7])) < 20.0


def test_top_p_one_keeps_the_whole_tail_despite_float_rounding():
    # Token 0 dominates, so in float32 the mass before every tail token rounds to 1.0: a plain
    # ">= top_p" test would drop the tail although top_p=1 means "off". Not observable by sampling
    # (the tail has ~1e-15 mass), hence the direct check of the filter.
    logits = torch.zeros(2, 1000)
    logits[:, 0] = 30.0
    logits[:, 1:] = torch.linspace(-5, -20, 999)
    probs = logits.softmax(dim=-1)
    assert float((probs.cumsum(-1) - probs)[0, -1]) >= 1.0  # the premise
    filtered = _top_k_top_p(logits.clone(), None, [1.0, 0.5])
    assert torch.isfinite(filtered[0]).all()
    assert torch.isfinite(filtered[1]).sum() == 1


def test_min_p_drops_tokens_below_min_p_times_max_prob():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 20_000
    # threshold 0.5 * 0.5 = 0.25: tokens 0 and 1 stay, renormalised to 5/8, 3/8.
    out = _sample(Sampler(seed=7), probs.log().expand(n, -1), _states(SamplingParams(min_p=0.5), n))
    assert _chi_square(out, torch.tensor([5 / 8, 3 / 8, 0.0, 0.0])) < 20.0


def test_min_p_one_keeps_only_the_top_token():
    logits = _logits(32)
    out = _sample(Sampler(seed=0), logits, _states(SamplingParams(min_p=1.0), 32))
    assert torch.equal(out, logits.argmax(dim=-1))


def test_rows_with_different_filters_in_one_batch_do_not_leak_into_each_other():
    logits = _logits(1)[0].expand(4, -1).contiguous()
    states = [
        SamplingState(SamplingParams(top_k=1)),
        SamplingState(SamplingParams(temperature=0.0)),
        SamplingState(SamplingParams(top_p=1e-6)),
        SamplingState(SamplingParams(min_p=1.0)),
    ]
    out = _sample(Sampler(seed=0), logits, states)
    assert out.tolist() == [int(logits[0].argmax())] * 4


def test_very_small_temperature_is_raised_and_stays_finite():
    logits = torch.tensor([[1000.0, 999.0, -1000.0]])
    out = _sample(Sampler(seed=0), logits, _states(SamplingParams(temperature=1e-8), 1))
    assert out.tolist() == [0]


def test_min_tokens_masks_eos_and_stop_token_ids_until_reached():
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 100.0
    logits[0, 9] = 90.0
    logits[0, 20] = 10.0
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(9,))
    sampler = Sampler(eos_token_id=EOS)
    assert _sample(sampler, logits, [SamplingState(params)], [0]).tolist() == [20]
    assert _sample(sampler, logits, [SamplingState(params)], [1]).tolist() == [20]
    assert _sample(sampler, logits, [SamplingState(params)], [2]).tolist() == [EOS]


def test_min_tokens_mask_applies_to_random_rows_too():
    logits = torch.zeros(2000, 5)
    logits[:, EOS] = 5.0
    out = _sample(Sampler(eos_token_id=EOS, seed=0), logits, _states(SamplingParams(min_tokens=1), 2000))
    assert EOS not in out.tolist()


def test_ignore_eos_does_not_mask_eos_under_min_tokens():
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 100.0
    params = SamplingParams(temperature=0.0, min_tokens=5, ignore_eos=True)
    assert _sample(Sampler(eos_token_id=EOS), logits, [SamplingState(params)], [0]).tolist() == [EOS]


def test_min_tokens_masks_every_eos_id_of_a_model_with_several():
    logits = torch.zeros(1, VOCAB)
    logits[0, [EOS, 7]] = torch.tensor([100.0, 90.0])
    params = SamplingParams(temperature=0.0, min_tokens=1)
    sampler = Sampler(eos_token_id=(EOS, 7))
    assert _sample(sampler, logits, [SamplingState(params)], [0]).tolist() == [0]


# -- penalties (vLLM's apply_penalties) ------------------------------------------------------------
def test_penalties_by_hand():
    # prompt [1], output [2, 2, 0]; repetition 2, presence 0.5, frequency 0.25:
    #   token 0: seen, 1 > 0 -> 1/2 = 0.5; once in the output -> 0.5 - 0.25 - 0.5 = -0.25
    #   token 1: seen in the prompt only, -1 <= 0 -> -1 * 2 = -2; not in the output -> -2
    #   token 2: seen, 2 -> 1; twice in the output -> 1 - 0.5 - 0.5 = 0
    #   token 3: unseen -> 0.5
    logits = torch.tensor([[1.0, -1.0, 2.0, 0.5]])
    out = apply_penalties(logits, [[1]], [[2, 2, 0]], [2.0], [0.5], [0.25])
    assert out.tolist() == [[-0.25, -2.0, 0.0, 0.5]]


def test_repetition_penalty_is_transformers_processor_over_prompt_and_output():
    transformers = pytest.importorskip("transformers")
    logits = _logits(3)
    prompts, outputs = [[1, 5, 5, 9], [0], [7, 8]], [[9, 12], [], [40, 41, 41]]
    ours = apply_penalties(logits.clone(), prompts, outputs, [1.3, 0.7, 2.0], [0.0] * 3, [0.0] * 3)
    for i, (p, o, r) in enumerate(zip(prompts, outputs, (1.3, 0.7, 2.0), strict=True)):
        ref = transformers.RepetitionPenaltyLogitsProcessor(r)(torch.tensor([p + o]), logits[i : i + 1].clone())
        assert torch.allclose(ours[i], ref[0], atol=1e-6)


def test_a_penalised_greedy_row_avoids_the_repeated_token_and_needs_the_token_ids():
    logits = torch.zeros(2, VOCAB)
    logits[:, 7], logits[:, 8] = 2.0, 1.5  # 7 wins unpenalised
    states = [SamplingState(SamplingParams(temperature=0.0, frequency_penalty=1.0)), SamplingState(SamplingParams(temperature=0.0))]
    ids = [([1, 2], [7]), ([1, 2], [7])]
    out = Sampler().sample(logits, states, [1, 1], ids)
    assert out.tolist() == [8, 7]  # row 0: 2 - 1 = 1 < 1.5; row 1 has no penalty
    assert logits[0, 7] == 2.0  # the caller's logits are not modified
    with pytest.raises(ValueError, match="token_ids"):
        Sampler().sample(logits, states, [1, 1])
