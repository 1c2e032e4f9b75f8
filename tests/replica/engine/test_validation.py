"""Bad requests are refused with an InvalidRequestError naming the field, before the engine
touches any state: no block allocated, nothing queued, the engine keeps serving (DESIGN.md §3.3)."""

from __future__ import annotations

import pytest
import torch

from replica.engine.config import EngineConfig
from replica.engine.engine import LLMEngine
from replica.engine.errors import InvalidRequestError
from replica.engine.params import FinishReason, SamplingParams

torch.set_num_threads(1)

MAX_MODEL_LEN = 64
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(default_model_dir) -> LLMEngine:
    eng = LLMEngine(
        default_model_dir,
        EngineConfig(
            device="cpu", block_size=16, num_blocks=16, max_model_len=MAX_MODEL_LEN, torch_threads=1
        ),
    )
    # A request holding blocks while the bad ones arrive, so "unchanged" is not just "empty".
    eng.add_request(list(range(10)), SamplingParams(max_tokens=50, **GREEDY), request_id="busy")
    eng.step()
    assert eng.kv.get_block_ids("busy")
    return eng


def engine_state(eng: LLMEngine):
    kv, sched = eng.kv, eng.scheduler
    return (
        kv.num_free_blocks,
        {rid: [b.block_id for b in blocks] for rid, blocks in kv.req_to_blocks.items()},
        [r.request_id for r in sched.waiting],
        [r.request_id for r in sched.running],
        sorted(eng._live),
        kv.stats.queries,
    )


BAD_REQUESTS = [
    ("empty text prompt", lambda e: ("", SamplingParams()), "prompt"),
    ("empty token prompt", lambda e: ([], SamplingParams()), "prompt"),
    ("prompt of max_model_len tokens", lambda e: ([1] * MAX_MODEL_LEN, SamplingParams()), "prompt"),
    ("prompt far over max_model_len", lambda e: ([1] * 1000, SamplingParams()), "prompt"),
    ("text prompt over max_model_len", lambda e: ("the harbour town " * 60, SamplingParams()), "prompt"),
    ("max_tokens 0", lambda e: ([1, 2], SamplingParams(max_tokens=0)), "max_tokens"),
    ("max_tokens -3", lambda e: ([1, 2], SamplingParams(max_tokens=-3)), "max_tokens"),
    ("temperature < 0", lambda e: ([1, 2], SamplingParams(temperature=-0.1)), "temperature"),
    ("top_p 0", lambda e: ([1, 2], SamplingParams(top_p=0.0)), "top_p"),
    ("top_p 1.5", lambda e: ([1, 2], SamplingParams(top_p=1.5)), "top_p"),
    ("top_k -2", lambda e: ([1, 2], SamplingParams(top_k=-2)), "top_k"),
    ("token id = vocab size", lambda e: ([1, e.vocab_size], SamplingParams()), "prompt.token_ids"),
    ("token id far outside", lambda e: ([10**9], SamplingParams()), "prompt.token_ids"),
    ("negative token id", lambda e: ([3, -1, 4], SamplingParams()), "prompt.token_ids"),
    (
        "unknown stop token id",
        lambda e: ([1, 2], SamplingParams(stop_token_ids=(5, e.vocab_size))),
        "stop_token_ids",
    ),
    ("negative stop token id", lambda e: ([1, 2], SamplingParams(stop_token_ids=(-1,))), "stop_token_ids"),
]


@pytest.mark.parametrize(("case", "make", "field"), BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request_is_refused_naming_the_field_before_any_allocation(engine, case, make, field):
    before = engine_state(engine)
    prompt, params = make(engine)
    with pytest.raises(InvalidRequestError) as exc:
        engine.add_request(prompt, params, request_id=f"bad-{case}")
    assert exc.value.field == field
    assert str(exc.value).startswith(f"{field}: ")
    assert engine_state(engine) == before
    # make_request (the thread-safe validation the service uses) refuses it the same way.
    with pytest.raises(InvalidRequestError) as exc:
        engine.make_request(prompt, params)
    assert exc.value.field == field
    engine.step()  # nothing of the bad request reaches the scheduler
    assert f"bad-{case}" not in engine.kv.req_to_blocks


def test_duplicate_request_id_is_refused_and_leaves_the_live_request_alone(engine):
    before = engine_state(engine)
    busy = engine.scheduler.running[0]
    computed = busy.num_computed_tokens
    with pytest.raises(InvalidRequestError) as exc:
        engine.add_request([7, 8, 9], SamplingParams(max_tokens=2), request_id="busy")
    assert exc.value.field == "request_id"
    assert engine_state(engine) == before and busy.num_computed_tokens == computed


def test_longest_allowed_prompt_is_accepted_and_gets_one_token(default_model_dir):
    """The boundary of the length rule: max_model_len - 1 prompt tokens leave room for exactly one."""
    eng = LLMEngine(
        default_model_dir,
        EngineConfig(device="cpu", block_size=16, num_blocks=8, max_model_len=MAX_MODEL_LEN, torch_threads=1),
    )
    free = eng.kv.num_free_blocks
    req = eng.add_request([5] * (MAX_MODEL_LEN - 1), SamplingParams(max_tokens=MAX_MODEL_LEN, **GREEDY))
    assert req.max_tokens == 1
    outs = eng.step()
    assert [(o.finished, o.finish_reason, o.completion_tokens) for o in outs] == [
        (True, FinishReason.LENGTH, 1)
    ]
    assert eng.kv.num_free_blocks == free


@pytest.mark.parametrize("max_model_len", [8193, 1, -5])
def test_max_model_len_outside_what_the_model_computes_is_refused_at_startup(
    default_model_dir, max_model_len
):
    """The default model has max_position_embeddings 8192: a longer max_model_len would run RoPE
    positions (or, for a sliding-window model, full attention) past what the model computes exactly,
    silently; the engine refuses to start instead, naming the setting (vLLM does the same)."""
    cfg = EngineConfig(
        device="cpu", block_size=16, num_blocks=300, max_model_len=max_model_len, torch_threads=1
    )
    with pytest.raises(ValueError, match=r"^max_model_len: .*8192"):
        LLMEngine(default_model_dir, cfg)


def test_max_model_len_equal_to_the_model_limit_is_accepted(default_model_dir):
    cfg = EngineConfig(device="cpu", block_size=16, num_blocks=513, max_model_len=8192, torch_threads=1)
    assert LLMEngine(default_model_dir, cfg).max_model_len == 8192
